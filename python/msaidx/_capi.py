"""The shared library through ctypes: loading, struct layouts, status checks, cached contexts."""

import atexit
import ctypes
import os
import sys
import threading

DEVICE_HOST = -1

DTYPE_E4M3 = 0
DTYPE_BF16 = 1
DTYPES = {"e4m3": DTYPE_E4M3, "bf16": DTYPE_BF16}

BACKENDS = {"auto": 0, "cpu": 1, "dense": 2, "split": 3, "persistent": 4}
DEVICE_BACKENDS = ("dense", "split", "persistent")

SUCCESS = 0


class Error(ValueError):
    """Bad input, or a failed msaidx call; the message names the offending argument.

    `status` holds the C library's status name when the error comes from a C call, else None.
    """

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


Error.__module__ = "msaidx"  # its public home, for tracebacks and pickling


class Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("head_dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("init_blocks", ctypes.c_int32),
        ("local_blocks", ctypes.c_int32),
        ("dtype", ctypes.c_int),
        ("backend", ctypes.c_int),
        ("device", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("fast_accumulation", ctypes.c_int32),
        ("precision", ctypes.c_int),
    ]


class BatchDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch_size", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32),
        ("max_q_len", ctypes.c_int32),
        ("max_seq_len", ctypes.c_int32),
        ("num_pages", ctypes.c_int32),
        ("bt_stride", ctypes.c_int32),
        ("page_stride", ctypes.c_int64),
        ("pitch", ctypes.c_int32),
        ("cp_world", ctypes.c_int32),
        ("cp_rank", ctypes.c_int32),
        ("cp_layout", ctypes.c_int32),
    ]


# msaidx_cp_layout
CP_LAYOUTS = {"interleaved": 0, "contiguous": 1}


class TopkArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("topk", ctypes.c_int32),
        ("init_blocks", ctypes.c_int32),
        ("local_blocks", ctypes.c_int32),
        ("out_stride_t", ctypes.c_int64),
        ("out_stride_h", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]


_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_size = ctypes.c_size_t
_status = ctypes.c_int

# name: (restype, argtypes)
_PROTOTYPES = {
    "msaidx_status_string": (ctypes.c_char_p, [_status]),
    "msaidx_version": (ctypes.c_char_p, []),
    "msaidx_last_error": (ctypes.c_char_p, []),
    "msaidx_config_init": (None, [ctypes.POINTER(Config)]),
    "msaidx_context_create": (_status, [ctypes.POINTER(_p), ctypes.POINTER(Config)]),
    "msaidx_context_destroy": (_status, [_p]),
    "msaidx_context_backend": (_status, [_p, ctypes.POINTER(ctypes.c_int)]),
    "msaidx_backend_name": (ctypes.c_char_p, [ctypes.c_int]),
    "msaidx_backend_supported": (_status, [ctypes.c_int, ctypes.POINTER(Config)]),
    "msaidx_batch_desc_init": (None, [ctypes.POINTER(BatchDesc)]),
    "msaidx_plan_create": (_status, [ctypes.POINTER(_p), _p, ctypes.POINTER(BatchDesc)]),
    "msaidx_plan_destroy": (_status, [_p]),
    "msaidx_plan_workspace_size": (_status, [_p, ctypes.POINTER(_size)]),
    "msaidx_plan_batch": (_status, [_p, _p, _p, _p, _p, _size, _p]),
    "msaidx_prefill_scores": (_status, [_p, _p, _p, _p, _p]),
    "msaidx_decode_scores": (_status, [_p, _p, _p, _p, _p]),
    "msaidx_plan_check": (_status, [_p, _p]),
    "msaidx_num_valid_pages": (_status, [_p, _p, _p, _i32, _i32, _p, _p]),
    "msaidx_topk_select": (_status, [_p, _p, _i32, _p, _i32, _p, _p]),
    "msaidx_topk_select_strided": (_status, [_p, _p, _i32, _p, _i32, _p, ctypes.c_int64,
                                             ctypes.c_int64, _p]),
    "msaidx_topk_select_bounded": (_status, [_p, _p, _i32, _i32, _p, _i32, _p, ctypes.c_int64,
                                             ctypes.c_int64, _p]),
    "msaidx_topk_args_init": (None, [ctypes.POINTER(TopkArgs)]),
    "msaidx_prefill_topk_workspace_size": (_status, [_p, _i32, ctypes.POINTER(_size)]),
    "msaidx_prefill_topk": (_status, [_p, _p, _p, ctypes.POINTER(TopkArgs), _p, _p, _p]),
    "msaidx_prefill_topk_candidates": (_status, [_p, _p, _p, ctypes.POINTER(TopkArgs), _p, _p,
                                                 _p, _p]),
    "msaidx_plan_nvp": (_status, [_p, ctypes.POINTER(_p)]),
    "msaidx_merge_candidates": (_status, [_p, ctypes.POINTER(TopkArgs), _i32, _i32, _p, _p, _p,
                                          ctypes.c_int64, _p, _p]),
    "msaidx_e4m3_from_float": (None, [_p, _p, _size]),
    "msaidx_e4m3_to_float": (None, [_p, _p, _size]),
    "msaidx_bf16_from_float": (None, [_p, _p, _size]),
    "msaidx_bf16_to_float": (None, [_p, _p, _size]),
}

_lib = None
_lib_lock = threading.Lock()


LIBRARY_NAME = "libmsaidx.so"


def library_path():
    """Where the library is loaded from: MSAIDX_LIBRARY if set (an explicit choice wins), else the
    package's folders (an installed package ships it there; an editable install's package spans
    the source folder and site-packages), else <checkout>/build/libmsaidx.so (`make`) when the
    package sits in a checkout, else the package's own folder (an installed package missing it)."""
    override = os.environ.get("MSAIDX_LIBRARY")
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    package = sys.modules.get(__package__)
    for folder in [here] + list(getattr(package, "__path__", [])):
        bundled = os.path.join(folder, LIBRARY_NAME)
        if os.path.isfile(bundled):
            return bundled
    checkout = os.path.normpath(os.path.join(here, "..", ".."))
    if os.path.isfile(os.path.join(checkout, "CMakeLists.txt")):
        return os.path.join(checkout, "build", LIBRARY_NAME)
    return os.path.join(here, LIBRARY_NAME)


def lib():
    """The loaded library; loaded on first use so that `import msaidx` never fails."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            if not os.path.isfile(path):
                raise Error(
                    f"msaidx shared library not found at {path}: install the package "
                    "(`pip install .`), or run `make` at the repository root, or set "
                    "MSAIDX_LIBRARY to the path of libmsaidx.so"
                )
            try:
                loaded = ctypes.CDLL(path)
            except OSError as error:
                raise Error(f"msaidx shared library {path} failed to load: {error}") from None
            for name, (restype, argtypes) in _PROTOTYPES.items():
                function = getattr(loaded, name, None)
                if function is None:
                    raise Error(f"{path} lacks {name}: it is not a libmsaidx this package can "
                                "use; rebuild it (`make`), reinstall the package, or unset "
                                "MSAIDX_LIBRARY")
                function.restype = restype
                function.argtypes = argtypes
            from . import __version__  # the package is imported by the time a call loads this
            built = loaded.msaidx_version().decode()
            if __version__ != "unknown" and built != __version__:
                raise Error(f"{path} is libmsaidx {built}, this package is msaidx {__version__}: "
                            "rebuild it (`make`), reinstall the package, or unset MSAIDX_LIBRARY")
            _lib = loaded
    return _lib


def last_error_message():
    return lib().msaidx_last_error().decode("utf-8", "replace")


def check(status, what):
    """Raises Error carrying the library's message (which names the argument) on failure."""
    if status == SUCCESS:
        return
    name = lib().msaidx_status_string(status).decode()
    raise Error(f"{what}: {last_error_message()} [{name}]", status=name)


PRECISIONS = ("default", "exact")
PRECISION_DEFAULT, PRECISION_EXACT = 0, 1
# msaidx.h's MSAIDX_FP8_ACCUMULATION_DOT_BOUND: at the default precision an E4M3 dot on
# `persistent` is within this times sum_d |q_d * k_d| of the exact value (131 * 2**-13).
FP8_ACCUMULATION_DOT_BOUND = 131.0 / 8192.0


def fast_accumulation_for(precision, dtype):
    """Whether a `precision` keyword lets E4M3 sum with FP8 tensor cores where a backend has them
    ("default", each dot within FP8_ACCUMULATION_DOT_BOUND * sum_d |q_d * k_d|) or keeps SPEC's
    exact tolerance ("exact"). The one place that maps the keyword to the C config."""
    if precision not in PRECISIONS:
        raise Error(f"precision = {precision!r}: must be one of {list(PRECISIONS)}")
    return int(precision == "default" and dtype == DTYPE_E4M3)


def make_config(backend, num_heads=4, dtype=DTYPE_E4M3, head_dim=128, page_size=128,
                device=DEVICE_HOST, topk=16, init_blocks=0, local_blocks=1, fast_accumulation=0):
    config = Config()
    lib().msaidx_config_init(ctypes.byref(config))
    config.head_dim = head_dim
    config.page_size = page_size
    config.num_heads = num_heads
    config.topk = topk
    config.init_blocks = init_blocks
    config.local_blocks = local_blocks
    config.dtype = dtype
    config.backend = BACKENDS[backend]
    config.device = device
    config.precision = PRECISION_DEFAULT if fast_accumulation else PRECISION_EXACT
    return config


class Context:
    """One msaidx_context; immutable once created, so one may serve several threads."""

    def __init__(self, config):
        handle = ctypes.c_void_p()
        check(lib().msaidx_context_create(ctypes.byref(handle), ctypes.byref(config)),
              "msaidx_context_create")
        self.handle = handle
        resolved = ctypes.c_int()
        check(lib().msaidx_context_backend(handle, ctypes.byref(resolved)),
              "msaidx_context_backend")
        self.backend = lib().msaidx_backend_name(resolved.value).decode()

    def destroy(self):
        if self.handle:
            lib().msaidx_context_destroy(self.handle)
            self.handle = None


_contexts = {}
_contexts_lock = threading.Lock()


def context(backend, **fields):
    """The cached context for this backend and config; created once per distinct key."""
    key = (backend, tuple(sorted(fields.items())))
    with _contexts_lock:
        found = _contexts.get(key)
        if found is None:
            found = Context(make_config(backend, **fields))
            _contexts[key] = found
        return found


@atexit.register
def _destroy_contexts():
    with _contexts_lock:
        for held in _contexts.values():
            held.destroy()
        _contexts.clear()


class Plan:
    """An msaidx_plan for one call (host allocation only); destroyed on leaving the block."""

    def __init__(self, held_context, desc):
        handle = ctypes.c_void_p()
        check(lib().msaidx_plan_create(ctypes.byref(handle), held_context.handle,
                                       ctypes.byref(desc)), "msaidx_plan_create")
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        lib().msaidx_plan_destroy(self.handle)
        self.handle = None
        return False

    def workspace_size(self):
        size = ctypes.c_size_t()
        check(lib().msaidx_plan_workspace_size(self.handle, ctypes.byref(size)),
              "msaidx_plan_workspace_size")
        return size.value


def backend_supported(backend, config):
    """None when admitted, else the library's reason."""
    status = lib().msaidx_backend_supported(BACKENDS[backend], ctypes.byref(config))
    return None if status == SUCCESS else last_error_message()
