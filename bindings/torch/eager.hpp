// The eager entries of the ops the drop-ins call outside torch.compile (eager.cpp), added to the
// extension's Python module.
#pragma once

#include <torch/extension.h>

namespace rome_torch {

void add_eager_entries(pybind11::module_& m);

}  // namespace rome_torch
