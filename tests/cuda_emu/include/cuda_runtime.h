// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for the CUDA runtime header (see kvemu.hpp).
#pragma once
#include "kvemu.hpp"
