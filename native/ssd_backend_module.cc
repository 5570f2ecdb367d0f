// The extension module ssd_backend._C: the native SSD files (ssd/) and what both modules share
// (common/). It needs nothing from tieredemb._C; its thread pool is this module's own.
#include "common/bindings.h"

namespace tieredemb {
void register_ssd(nb::module_& m);  // ssd/bindings.cc
}  // namespace tieredemb

NB_MODULE(_C, m) {
  m.doc() = "ssd_backend native files: SlotFile, LogFile, row copies";
  nanobind::set_leak_warnings(false);
  tieredemb::register_common(m);
  tieredemb::register_ssd(m);
}
