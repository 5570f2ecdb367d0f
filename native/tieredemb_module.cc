// The extension module tieredemb._C: the tier index (index/), the batch kernels (kernels/), the
// package's lock (counted_lock.cc), the guard of a dropped batch (drop_guard.cc), and what both
// modules share (common/). Its thread pool is this module's own.
#include "common/bindings.h"

namespace tieredemb {
void register_index(nb::module_& m);    // index/bindings.cc
void register_kernels(nb::module_& m);  // kernels/bindings.cc
void register_locks(nb::module_& m);    // counted_lock.cc
void register_drop_guard(nb::module_& m);  // drop_guard.cc
}  // namespace tieredemb

NB_MODULE(_C, m) {
  m.doc() = "tieredemb native core: tier indexes, eviction policies, batch kernels";
  // Tables alive at interpreter exit (module globals, autograd graphs) are not leaks.
  nanobind::set_leak_warnings(false);
  tieredemb::register_common(m);
  tieredemb::register_index(m);
  tieredemb::register_kernels(m);
  tieredemb::register_locks(m);
  tieredemb::register_drop_guard(m);
}
