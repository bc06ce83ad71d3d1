// The Python module tk_backend._C: importing it registers the CUDA kernels of every tk:: op.
#include <Python.h>

static PyModuleDef tk_module = {PyModuleDef_HEAD_INIT, "_C", "tk_backend CUDA kernels (torch.ops.tk)", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&tk_module); }
