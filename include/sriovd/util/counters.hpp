#pragma once
// A stats struct's counters, named once: sriovctl's JSON and the Prometheus
// families are both made from the same table, so a counter renamed or added
// in one place is renamed or added in both - never a key that silently
// reads 0 on the other side.

#include <cstdint>

namespace sriovd {

template <typename T>
struct Counter {
  const char* name;  // the JSON key, and the metric's name before "_total"
  const char* help;  // the metric's help text
  uint64_t T::*field;
};

}  // namespace sriovd
