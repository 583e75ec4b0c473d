// A successor's VFIO device from its predecessor's part (an upgrade in
// place, daemon/handover.hpp): the kernel's device with its container and
// group as they stand, or the simulated VF with its BAR0 memfd and state.
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "sriovd/util/error.hpp"
#include "sriovd/vfio/device.hpp"
#include "sriovd/vfio/kernel.hpp"
#include "sriovd/vfio/simulated.hpp"

namespace sriovd::vfio {

std::unique_ptr<Device> adopt_device(std::span<const uint8_t> part, HandedFds& fds, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(part.begin(), part.end());
    const auto fd = [&](const char* key) {
      const uint32_t i = j.at(key).get<uint32_t>();
      UniqueFd f = fds.take_fd(i);
      if (!f) throw std::invalid_argument(what + ": " + key + " names no handed fd");
      return f;
    };
    const std::string kind = j.at("kind").get<std::string>();
    const std::string name = j.at("name").get<std::string>();
    if (kind == "kernel") {
      std::vector<KernelDevice::Window> windows;
      for (const auto& w : j.at("windows")) windows.push_back({w.at(0).get<uint64_t>(), w.at(1).get<uint64_t>()});
      UniqueFd container = fd("container"), group = fd("group"), device = fd("device");
      return KernelDevice::adopt(name, std::move(container), std::move(group), j.at("group_number").get<int>(),
                                 std::move(device), windows);
    }
    if (kind == "simulated") {
      const std::vector<uint8_t> config = j.at("config").get<std::vector<uint8_t>>();
      const auto vectors = j.at("vectors").get<uint16_t>();
      if (config.size() < 4 || vectors == 0) throw std::invalid_argument(what + ": a simulated VF without a config");
      auto d = std::make_unique<SimulatedDevice>(name, static_cast<uint16_t>(config[0] | config[1] << 8U),
                                                 static_cast<uint16_t>(config[2] | config[3] << 8U), vectors);
      d->take_over(fd("bar0"), config, j.at("msix_enabled").get<bool>(), j.at("generated").get<uint64_t>());
      if (j.contains("generator")) {
        const auto& g = j["generator"];
        auto on = g.at("vectors").get<std::vector<uint32_t>>();
        for (uint32_t v : on)
          if (v >= vectors) throw std::invalid_argument(what + ": the generator's vector " + std::to_string(v));
        if (!on.empty()) d->start_generator(std::move(on), g.at("rate").get<double>(), g.at("burst").get<unsigned>());
      }
      return d;
    }
    throw std::invalid_argument(what + ": a device of kind '" + kind + "'");
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(what + ": " + e.what());
  } catch (const SystemError& e) {
    throw std::invalid_argument(what + ": " + e.what());
  }
}

}  // namespace sriovd::vfio
