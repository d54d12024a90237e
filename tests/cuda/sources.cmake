# SPDX-License-Identifier: Apache-2.0
# The CUDA test executables and their sources, for the nvcc build (CMakeLists.txt here) and the
# emulated one (tests/cuda_emu). The kernels' test is two translation units, decode and prefill,
# so that the compiler builds the two kernel families side by side (either alone is most of the
# CUDA build's time).
set(kvcache_cuda_tests cuda_kernels_test device_paged_test)
set(kvcache_cuda_test_cuda_kernels_test cuda_decode_test.cu cuda_prefill_test.cu)
set(kvcache_cuda_test_device_paged_test device_paged_test.cu)
