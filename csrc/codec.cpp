// Placeholder until the native codec lands: registers nothing yet.
#include <pybind11/pybind11.h>
namespace zipserv {
void register_codec(pybind11::module_&) {}
}
