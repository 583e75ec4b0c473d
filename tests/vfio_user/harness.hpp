#pragma once
// What the virtio-pci tests share: a virtio-net device exported over
// vfio-user, the protocol served on an io thread of its own.
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "sriovd/irq/engine.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"

namespace sriovd::test {

// A device exported over vfio-user on `socket`, served on an io thread of
// its own; stopped when it goes.
struct Exported {
  Exported(const std::string& socket, const virtio::NetConfig& nc, std::unique_ptr<virtio::PacketPort> port)
      : net(nc, engine, std::move(port)),
        pci(net, engine, nc.name),
        server(io, socket, pci),
        thread([this] { io.run(); }) {}
  // A successor's: the client of `handover` served where its predecessor
  // stopped.
  Exported(const std::string& socket, const virtio::NetConfig& nc, std::unique_ptr<virtio::PacketPort> port,
           vfio_user::ServerHandover handover)
      : net(nc, engine, std::move(port)),
        pci(net, engine, nc.name),
        server(io, socket, pci, {}, std::move(handover)),
        thread([this] { io.run(); }) {}
  ~Exported() {
    io.stop();
    thread.join();
  }
  Exported(const Exported&) = delete;
  Exported& operator=(const Exported&) = delete;
  // Runs fn on the io thread and waits for its result.
  template <typename F>
  auto on_io(F fn) {
    std::promise<decltype(fn())> p;
    asio::post(io, [&] { p.set_value(fn()); });
    return p.get_future().get();
  }
  irq::Engine engine{irq::EngineOptions{}};
  virtio::NetDevice net;
  vfio_user::VirtioPci pci;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  vfio_user::Server server;
  std::thread thread;
};

}  // namespace sriovd::test
