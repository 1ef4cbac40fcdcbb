// zipserv_vllm._simt: the CUDA kernels' own sources (csrc/cuda/*.cu, compiled
// by g++ with ZIPSERV_SIMT) run on the CPU by the SIMT harness, behind the
// same bindings as zipserv_vllm._cuda (csrc/cuda/bindings.cpp): pointers are
// host addresses (numpy arrays, CPU tensors), the stream is ignored, every
// launch is synchronous. Plus the harness's settings, counters and
// self-tests. Built by csrc/simt/simt_build.py (plain, or under ASan / TSan).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "simt/control.h"
#include "simt/selftest.h"
#include "zipserv/decode_lane.h"

namespace py = pybind11;

namespace zipserv {
namespace cuda {
void bind_kernels(py::module_& m);
}
}  // namespace zipserv

PYBIND11_MODULE(_simt, m) {
  m.doc() = "The zipserv CUDA kernels' sources run on the CPU by the SIMT harness (same API as _cuda)";
  zipserv::cuda::bind_kernels(m);

  m.def(
      "configure",
      [](const std::string& schedule, uint64_t seed, py::object device_max_dynamic_shared) {
        auto& o = simt::options();
        if (schedule == "forward") o.schedule = simt::Schedule::Forward;
        else if (schedule == "reverse") o.schedule = simt::Schedule::Reverse;
        else if (schedule == "random") o.schedule = simt::Schedule::Random;
        else throw std::invalid_argument("schedule must be forward, reverse or random, got " + schedule);
        o.seed = seed;
        if (!device_max_dynamic_shared.is_none()) o.device_max_dynamic_shared = device_max_dynamic_shared.cast<size_t>();
      },
      py::arg("schedule") = "forward", py::arg("seed") = 1, py::arg("device_max_dynamic_shared") = py::none(),
      "Order in which a block's ready threads resume, the seed of the random order and of the shared-memory "
      "garbage, and the device's per-block dynamic shared-memory limit");
  m.def("settings", []() {
    const auto& o = simt::options();
    const char* names[] = {"forward", "reverse", "random"};
    py::dict d;
    d["schedule"] = names[static_cast<int>(o.schedule)];
    d["seed"] = o.seed;
    d["device_max_dynamic_shared"] = o.device_max_dynamic_shared;
    return d;
  });
  m.def("stats", []() {
    const auto& s = simt::stats();
    py::dict d;
    d["launches"] = s.launches;
    d["blocks"] = s.blocks;
    d["threads"] = s.threads;
    d["barriers"] = s.barriers;
    d["collectives"] = s.collectives;
    d["mma"] = s.mma;
    d["cp_async"] = s.cp_async;
    d["switches"] = s.switches;
    return d;
  }, "Counters since the last reset_stats(): what the harness executed");
  m.def("reset_stats", []() { simt::stats() = simt::Stats{}; });
  m.def("reset_device", &simt::reset_device, "Forget every cudaFuncSetAttribute, as on a fresh device");
  m.def(
      "lane_decode_one",
      [](uint64_t p0, uint64_t p1, uint64_t p2, int base_exp, const std::vector<uint8_t>& sm,
         const std::vector<uint16_t>& fb, int h_before, int f_before, int lane) {
        if (lane < 0 || lane > 31) throw std::invalid_argument("lane must be 0..31, got " + std::to_string(lane));
        return zipserv::decode_lane_pair(p0, p1, p2, base_exp, sm.data(), fb.data(), h_before, f_before, lane);
      },
      "The kernels' per-lane decode (decode_lane.h) called directly, for hand-checked cases");
  m.def("take_failure", &simt::take_failure, "Message of the last failed launch (then cleared)");
  m.attr("ASAN") = simt::asan_build();
  m.attr("TSAN") = simt::tsan_build();

  m.def(
      "selftest",
      [](const std::string& name, const std::vector<uint32_t>& in, int threads, int arg, int width, int op,
         int dynamic_smem) {
        const auto r = simt::selftest::run(name, in, threads, arg, width, op, dynamic_smem);
        return py::make_tuple(r.error, r.message, r.out);
      },
      py::arg("name"), py::arg("inputs") = std::vector<uint32_t>{}, py::arg("threads") = 32, py::arg("arg") = 0,
      py::arg("width") = 32, py::arg("op") = 0, py::arg("dynamic_smem") = 0,
      "Run one harness self-test kernel -> (cudaError, message, per-thread outputs)");
}
