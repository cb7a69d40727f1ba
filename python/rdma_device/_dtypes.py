"""NumPy dtypes <-> the 32-bit dtype code the transport carries.

The library treats the code as opaque. Types TensorFlow knows get
TensorFlow's DataType value, so a tensor pushed by the endpoint API reads
the same to a TensorFlow task; the rest get codes of their own (from
0x10000 up, far from TensorFlow's range). Only fixed-size types whose bytes
are the value travel: object, string and structured arrays are refused.
"""

import numpy as np

# TensorFlow's DataType values (tensorflow/core/framework/types.proto).
_TF = {
    "float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6,
    "complex64": 8, "int64": 9, "bool": 10, "uint16": 17, "complex128": 18,
    "float16": 19, "uint32": 22, "uint64": 23,
}
_TIME_UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")

_TO_CODE = {}
_FROM_CODE = {}


def _add(dtype, code):
    dtype = np.dtype(dtype)
    _TO_CODE[dtype] = code
    _FROM_CODE[code] = dtype


for _name, _code in _TF.items():
    _add(_name, _code)
_add(np.longdouble, 0x10001)
_add(np.clongdouble, 0x10002)
for _i, _unit in enumerate(_TIME_UNITS):
    _add(f"datetime64[{_unit}]", 0x10100 + _i)
    _add(f"timedelta64[{_unit}]", 0x10200 + _i)
try:  # bfloat16 as TensorFlow's own NumPy extension type (ml_dtypes), if present
    import ml_dtypes

    _add(ml_dtypes.bfloat16, 14)
except ImportError:
    pass


def supported():
    """Every dtype the endpoint API carries, in a stable order."""
    return sorted(_TO_CODE, key=lambda d: _TO_CODE[d])


def native(dtype):
    """``dtype`` in this machine's byte order."""
    dtype = np.dtype(dtype)
    return dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype


def code_of(dtype):
    """The wire code of ``dtype`` (native byte order); TypeError if it
    cannot travel."""
    dtype = native(dtype)
    try:
        return _TO_CODE[dtype]
    except KeyError:
        raise TypeError(f"rdma_device: dtype {dtype} cannot travel (fixed-size numeric, bool, "
                        "datetime64 and timedelta64 types only)") from None


def from_code(code):
    """The dtype of wire code ``code``; None when unknown."""
    return _FROM_CODE.get(code)
