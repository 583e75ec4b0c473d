# shellcheck shell=dash disable=SC3043  # busybox ash runs it in the guest (it has local)
# A Linux guest whose vhost-user back-end (sriovd) is killed and restarted
# while the guest runs: QEMU (reconnect=1) connects to the new daemon and
# traffic resumes. The host side kills sriovd when it sees phase 1 pass.
set -u
# shellcheck source=../guest-lib.sh
. /guest-lib.sh
guest_net_up 10.88.0.2/24
if ping -c 3 -W 3 10.88.0.1 >/dev/null 2>&1; then echo "VMTEST PASS phase1-before-restart"; else
  echo "VMTEST FAIL phase1-before-restart"; fi
# The host restarts sriovd now; give it up to 60 s to come back.
i=0
ok=0
while [ $i -lt 30 ]; do
  sleep 2
  if ping -c 1 -W 2 10.88.0.1 >/dev/null 2>&1; then ok=1; break; fi
  i=$((i + 1))
done
if [ $ok -eq 1 ] && ping -c 5 -W 3 10.88.0.1 >/tmp/ping2.log 2>&1; then
  echo "VMTEST PASS phase2-after-daemon-restart"
else
  echo "VMTEST FAIL phase2-after-daemon-restart: $(tail -n 2 /tmp/ping2.log 2>/dev/null | tr '\n' ' ')"
fi
