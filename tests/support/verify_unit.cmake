# Runs `systemd-analyze verify` on the unit built for tests. The unit's
# ConditionPathExists names /etc/sriovd/sriovd.yaml, which a build machine
# need not have; a condition is not an error, so it is checked as written.
find_program(SYSTEMD_ANALYZE systemd-analyze REQUIRED)
# The unit's Documentation= names man pages, which verify looks up with
# man(1): the ones built (build/man/manN), as the package installs them.
if(MANPATH)
  set(ENV{MANPATH} ${MANPATH})
endif()
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${SYSTEMD_ANALYZE} verify ${UNIT}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
# systemd-analyze exits 0 on warnings it prints; any line about our unit fails the test.
string(REGEX MATCHALL "[^\n]*sriovd\\.service[^\n]*" complaints "${out}${err}")
if(NOT rc EQUAL 0 OR complaints)
  message(FATAL_ERROR "systemd-analyze verify ${UNIT} failed (rc ${rc}):\n${out}${err}")
endif()
message(STATUS "systemd-analyze verify: ${UNIT} OK")
