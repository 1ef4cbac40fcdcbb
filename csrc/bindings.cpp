// pybind11 module zipserv_vllm._C: declares the Python surface and forwards.
// The format constants come from the single C++ definition (format.h) so a
// test can compare them with zipserv_vllm/format/spec.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "zipserv/format.h"

namespace py = pybind11;

namespace zipserv {
void register_codec(py::module_& m);  // csrc/codec.cpp
}

static py::dict format_constants() {
  using namespace zipserv;
  py::dict d;
  d["magic"] = kMagic;
  d["version"] = kVersion;
  d["tile"] = kTile;
  d["frag"] = kFrag;
  d["frags_per_tile"] = kFragsPerTile;
  d["planes"] = kPlanes;
  d["window"] = kWindow;
  d["min_window_start"] = kMinWindowStart;
  d["max_window_start"] = kMaxWindowStart;
  d["sm_align"] = kSmAlign;
  d["fb_align"] = kFbAlign;
  d["pad_code"] = kPadCode;
  d["pad_sm"] = static_cast<int>(kPadSm);
  d["meta_len"] = kMetaLen;
  d["meta_len_minor0"] = kMetaLenMinor0;
  d["no_crc"] = kNoCrc;
  d["tile_bitmap_bytes"] = kTileBitmapBytes;
  std::vector<int> r0, c0;
  for (int f = 0; f < kFragsPerTile; ++f) {
    r0.push_back(frag_row0(f));
    c0.push_back(frag_col0(f));
  }
  d["frag_row0"] = r0;
  d["frag_col0"] = c0;
  return d;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "zipserv-vllm native codec (TCA-TBE v1)";
  m.def("format_constants", &format_constants, "Every layout constant of format.h");
  zipserv::register_codec(m);
}
