"""Loading libdte.so and declaring its C ABI (sync/capi/c_api.h) for ctypes."""

import ctypes
import os
from typing import Any, Dict, Iterator, List, Tuple

C_API_VERSION = 14  # DTE_C_API_VERSION of sync/capi/c_api.h
DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_F64, DTYPE_OTHER = 0, 1, 2, 3, 255
MEMORY_HOST, MEMORY_CUDA = 0, 1
PATH_ADAMW, PATH_WEIGHTS = 0, 1  # dte_publish_result.path
# sync/capi/c_api.h enum dte_adamw_order
ORDERS = {"torch_cpu": 0, "torch_cuda_foreach": 1, "torch_cuda_single_tensor": 2,
          "torch_cuda_fused": 3, "torch_cuda_fused_fp32": 4}

class Array(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


class AdamWParam(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("param", Array), ("exp_avg", Array),
                ("exp_avg_sq", Array), ("state_step", ctypes.c_int64), ("lr", ctypes.c_double),
                ("weight_decay", ctypes.c_double)]


class McoreLayout(ctypes.Structure):
    _fields_ = [("tp", ctypes.c_int32), ("ep", ctypes.c_int32), ("etp", ctypes.c_int32),
                ("vocab_divisible_by", ctypes.c_int64), ("norms", ctypes.c_int32),
                ("experts", ctypes.c_int32)]


class McoreAdamWShard(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("tp_rank", ctypes.c_int32),
                ("ep_rank", ctypes.c_int32), ("param", Array), ("exp_avg", Array),
                ("exp_avg_sq", Array), ("state_step", ctypes.c_int64), ("lr", ctypes.c_double),
                ("weight_decay", ctypes.c_double)]


MCORE_NORMS = {"te": 0, "transformer_engine": 0, "local": 1}
MCORE_EXPERTS = {"sequential": 0, "grouped": 1}


class AdamWStep(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("step", ctypes.c_int64), ("amsgrad", ctypes.c_int32),
                ("maximize", ctypes.c_int32), ("order", ctypes.c_int32)]


class AdamWRange(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("tp_rank", ctypes.c_int32),
                ("ep_rank", ctypes.c_int32), ("begin", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("param", ctypes.c_void_p), ("exp_avg", ctypes.c_void_p),
                ("exp_avg_sq", ctypes.c_void_p), ("state_step", ctypes.c_int64),
                ("lr", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("memory", ctypes.c_int32), ("device", ctypes.c_int32)]


class DistStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "entries_sent", "bytes_sent", "bytes_received", "tensors_owned", "parent_bytes_read",
        "messages_sent", "push_tensors_kept", "push_tensors_read_back", "detect_ns", "encode_ns",
        "commit_ns", "detect_device_bytes")]


class Message(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_int32), ("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64)]


# int (*)(void* ctx, const dte_message* sends, size_t, const dte_message* recvs, size_t,
#         char* error, size_t error_size)
EXCHANGE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Message),
                               ctypes.c_size_t, ctypes.POINTER(Message), ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_size_t)


class PublishResult(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "version", "parent", "tensors", "elements", "changed", "flagged", "false_positives",
        "uncertain", "stored_bytes", "state_bytes", "parent_bytes")] + [("path", ctypes.c_int32)]


class WeightsTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("weights", Array)]


class PushTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("data", ctypes.c_void_p),
                ("device", ctypes.c_int32)]


class TensorTableEntry(ctypes.Structure):  # dte_tensor_info
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("bytes", ctypes.c_uint64),
                ("file", ctypes.c_char_p), ("offset", ctypes.c_uint64), ("hash", ctypes.c_char_p)]


class PushReceiverStatus(ctypes.Structure):
    _fields_ = [("has_version", ctypes.c_int32), ("version", ctypes.c_uint64),
                ("inconsistent", ctypes.c_int32), ("connected", ctypes.c_int32),
                ("has_behind", ctypes.c_int32), ("behind", ctypes.c_uint64),
                ("pending", ctypes.c_uint64), ("pushes", ctypes.c_uint64),
                ("elements", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("staged_bytes", ctypes.c_uint64)]


# Live apply (sync/live/live_abi.h): the ioctl structs, field for field.
LIVE_ABI_VERSION = 4
LIVE_LATEST = 2**64 - 1  # DTE_LIVE_LATEST
LIVE_MESSAGE_BYTES, LIVE_NAME_BYTES, LIVE_MAX_DIMS = 1024, 256, 8
LIVE_SERVER_BYTES = 64
LIVE_HOST_SHM, LIVE_CUDA_IPC = 0, 1


class LiveCounts(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "from_version", "to_version", "entries", "bytes", "pages", "receivers", "buffers",
        "elapsed_ns", "decode_ns", "scatter_ns", "pagecache_ns", "blocks", "compared_blocks")]


class LiveApply(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("version", ctypes.c_uint64), ("error", ctypes.c_int32),
                ("prepared", ctypes.c_uint32), ("counts", LiveCounts),
                ("message", ctypes.c_char * LIVE_MESSAGE_BYTES)]


class LiveStatus(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("applying", ctypes.c_uint32),
                ("live_version", ctypes.c_uint64), ("latest_version", ctypes.c_uint64),
                ("receivers", ctypes.c_uint64), ("buffers", ctypes.c_uint64),
                ("applies", ctypes.c_uint64), ("failed_applies", ctypes.c_uint64),
                ("last_apply_time", ctypes.c_int64), ("last_error", ctypes.c_int32),
                ("prepared", ctypes.c_uint32), ("last", LiveCounts),
                ("last_message", ctypes.c_char * LIVE_MESSAGE_BYTES)]


class LiveRegister(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("kind", ctypes.c_uint32),
                ("tp", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("fuse_qkv", ctypes.c_uint32), ("fuse_gate_up", ctypes.c_uint32),
                ("name", ctypes.c_char * LIVE_NAME_BYTES), ("dtype", ctypes.c_char * 8),
                ("ndim", ctypes.c_uint32), ("fp8_block", ctypes.c_uint32),
                ("shape", ctypes.c_int64 * LIVE_MAX_DIMS),
                ("shm_name", ctypes.c_char * LIVE_NAME_BYTES), ("offset", ctypes.c_uint64),
                ("cuda_ipc_handle", ctypes.c_uint8 * 64), ("cuda_device", ctypes.c_int32),
                ("fp8_scale_rule", ctypes.c_uint32), ("buffer_id", ctypes.c_uint64),
                ("error", ctypes.c_int32), ("reserved2", ctypes.c_uint32),
                ("message", ctypes.c_char * LIVE_MESSAGE_BYTES), ("version", ctypes.c_uint64),
                ("server", ctypes.c_char * LIVE_SERVER_BYTES), ("server_size", ctypes.c_int32),
                ("reserved3", ctypes.c_uint32)]


def _candidates() -> Iterator[str]:
    env = os.environ.get("DTE_LIBRARY")
    if env:
        yield env
    yield os.path.join(os.path.dirname(os.path.abspath(__file__)), "libdte.so")
    build = os.environ.get("DTE_BUILD_DIR")
    if build:
        yield os.path.join(build, "sync", "libdte.so")


def _load() -> ctypes.CDLL:
    tried: List[str] = []
    for path in _candidates():
        if os.path.exists(path):
            return ctypes.CDLL(path)
        tried.append(path)
    raise ImportError("dte: libdte.so not found (looked at %s); set DTE_LIBRARY to the built "
                      "library or install the package with pip" % ", ".join(tried))


def _publish_signatures() -> Dict[str, Tuple[Any, List[Any]]]:
    """(result type, argument types) of the publishers', the transports',
    the store reader's and the tensor tables' functions."""
    P = ctypes.c_void_p
    return {
        "dte_last_error": (ctypes.c_char_p, []),
        "dte_c_api_version": (ctypes.c_int, []),
        "dte_code_transient": (ctypes.c_int, [ctypes.c_int]),
        "dte_publisher_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                              ctypes.POINTER(P)]),
        "dte_publisher_close": (ctypes.c_int, [P]),
        "dte_publisher_import": (ctypes.c_int, [P, ctypes.c_char_p,
                                                ctypes.POINTER(ctypes.c_uint64)]),
        "dte_publisher_set_anchor_policy": (ctypes.c_int, [P, ctypes.c_double, ctypes.c_uint64]),
        "dte_publisher_set_join_budget": (ctypes.c_int, [P, ctypes.c_double]),
        "dte_publisher_publish_adamw": (ctypes.c_int, [P, ctypes.POINTER(AdamWStep),
                                                       ctypes.POINTER(AdamWParam), ctypes.c_size_t,
                                                       ctypes.POINTER(PublishResult)]),
        "dte_publisher_publish_weights": (ctypes.c_int, [P, ctypes.c_int64,
                                                         ctypes.POINTER(WeightsTensor),
                                                         ctypes.c_size_t,
                                                         ctypes.POINTER(PublishResult)]),
        "dte_publisher_weights_begin": (ctypes.c_int, [P, ctypes.c_int64]),
        "dte_publisher_weights_add": (ctypes.c_int, [P, ctypes.POINTER(WeightsTensor)]),
        "dte_publisher_weights_commit": (ctypes.c_int, [P, ctypes.POINTER(PublishResult)]),
        "dte_publisher_open_mcore": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p,
                                                    ctypes.c_char_p, ctypes.c_char_p,
                                                    ctypes.POINTER(McoreLayout),
                                                    ctypes.POINTER(P)]),
        "dte_publisher_publish_adamw_mcore": (ctypes.c_int, [P, ctypes.POINTER(AdamWStep),
                                                             ctypes.POINTER(McoreAdamWShard),
                                                             ctypes.c_size_t,
                                                             ctypes.POINTER(PublishResult)]),
        "dte_transport_tcp": (ctypes.c_int, [ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p,
                                             ctypes.c_int64, ctypes.c_char_p,
                                             ctypes.POINTER(P)]),
        "dte_transport_callback": (ctypes.c_int, [ctypes.c_int32, ctypes.c_int32, EXCHANGE_FN,
                                                  ctypes.c_void_p, ctypes.POINTER(P)]),
        "dte_transport_store": (ctypes.c_int, [P, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p,
                                               ctypes.c_int64, ctypes.POINTER(P)]),
        "dte_transport_close": (ctypes.c_int, [P]),
        "dte_publisher_set_group": (ctypes.c_int, [P, ctypes.c_int32, ctypes.c_int32, P]),
        "dte_publisher_last_stats": (ctypes.c_int, [P, ctypes.POINTER(DistStats)]),
        "dte_publisher_publish_ranges": (ctypes.c_int, [P, ctypes.POINTER(AdamWStep),
                                                        ctypes.POINTER(AdamWRange),
                                                        ctypes.c_size_t,
                                                        ctypes.POINTER(PublishResult)]),
        "dte_store_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(P)]),
        "dte_store_close": (ctypes.c_int, [P]),
        "dte_store_latest": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int),
                                            ctypes.POINTER(ctypes.c_uint64)]),
        "dte_store_read_tensor": (ctypes.c_int, [P, ctypes.c_uint64, ctypes.c_char_p,
                                                 ctypes.c_void_p, ctypes.c_uint64]),
        "dte_store_list_versions": (ctypes.c_int, [P, ctypes.c_int32, ctypes.c_uint64,
                                                   ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)),
                                                   ctypes.POINTER(ctypes.c_size_t)]),
        "dte_store_version_tensors": (ctypes.c_int, [P, ctypes.c_uint64, ctypes.POINTER(P)]),
        "dte_safetensors_tensors": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(P)]),
        "dte_tensor_table_entries": (ctypes.c_int, [P,
                                                    ctypes.POINTER(ctypes.POINTER(TensorTableEntry)),
                                                    ctypes.POINTER(ctypes.c_size_t)]),
        "dte_tensor_table_close": (ctypes.c_int, [P]),
        "dte_dtype_width": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32)]),
    }


def _push_signatures() -> Dict[str, Tuple[Any, List[Any]]]:
    """The push's, metrics' and live apply's functions."""
    P = ctypes.c_void_p
    return {
        "dte_push_server_start": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p,
                                                 ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_char_p,
                                                 ctypes.c_char_p, ctypes.POINTER(P)]),
        "dte_push_server_address": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_char_p)]),
        "dte_push_server_set_group": (ctypes.c_int, [P, ctypes.c_int32, ctypes.c_int32]),
        "dte_push_server_close": (ctypes.c_int, [P]),
        "dte_push_server_port": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int32)]),
        "dte_push_server_status_json": (ctypes.c_int, [P, ctypes.c_int32,
                                                       ctypes.POINTER(ctypes.c_char_p)]),
        "dte_publisher_set_push": (ctypes.c_int, [P, P]),
        "dte_publisher_last_push_json": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_char_p)]),
        "dte_publisher_share_push": (ctypes.c_int, [P]),
        "dte_publisher_metrics_text": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_char_p)]),
        "dte_publisher_serve_metrics": (ctypes.c_int, [P, ctypes.c_char_p,
                                                       ctypes.POINTER(ctypes.c_int32)]),
        "dte_publisher_push_metrics": (ctypes.c_int, [P, ctypes.c_char_p, ctypes.c_char_p,
                                                      ctypes.POINTER(ctypes.c_char_p),
                                                      ctypes.POINTER(ctypes.c_char_p),
                                                      ctypes.c_size_t]),
        "dte_push_receiver_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int32,
                                                  ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                                  ctypes.c_int32, ctypes.c_uint64,
                                                  ctypes.POINTER(PushTensor), ctypes.c_size_t,
                                                  ctypes.c_int32, ctypes.c_int64, ctypes.c_char_p,
                                                  ctypes.POINTER(P)]),
        "dte_push_receiver_open_fp8": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int32,
                                                      ctypes.c_int32, ctypes.c_int32,
                                                      ctypes.c_int32, ctypes.c_int32,
                                                      ctypes.c_uint64, ctypes.POINTER(PushTensor),
                                                      ctypes.c_size_t, ctypes.c_int32,
                                                      ctypes.c_int64, ctypes.c_char_p,
                                                      ctypes.c_uint64, ctypes.c_uint64,
                                                      ctypes.c_int32, ctypes.POINTER(P)]),
        "dte_push_receiver_open_server": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int32,
                                                         ctypes.c_int32, ctypes.c_int32,
                                                         ctypes.c_int32, ctypes.c_int32,
                                                         ctypes.c_uint64,
                                                         ctypes.POINTER(PushTensor),
                                                         ctypes.c_size_t, ctypes.c_int32,
                                                         ctypes.c_int64, ctypes.c_char_p,
                                                         ctypes.c_int32, ctypes.c_uint64,
                                                         ctypes.c_uint64, ctypes.c_int32,
                                                         ctypes.c_char_p, ctypes.c_int32,
                                                         ctypes.c_uint64, ctypes.POINTER(P)]),
        "dte_push_receiver_move_to": (ctypes.c_int, [P, P, ctypes.c_uint64]),
        "dte_push_receiver_path": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_uint64),
                                                  ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_size_t)]),
        "dte_push_receiver_apply_agreed": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_uint64),
                                                          ctypes.POINTER(ctypes.c_size_t),
                                                          ctypes.c_size_t,
                                                          ctypes.POINTER(ctypes.c_uint64)]),
        "dte_push_receiver_server_status": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int32),
                                                           ctypes.POINTER(ctypes.c_uint64),
                                                           ctypes.POINTER(ctypes.c_int32),
                                                           ctypes.POINTER(ctypes.c_char_p)]),
        "dte_push_receiver_close": (ctypes.c_int, [P]),
        "dte_push_receiver_apply_pending": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_uint64)]),
        "dte_push_receiver_wait_for": (ctypes.c_int, [P, ctypes.c_uint64, ctypes.c_int64]),
        "dte_push_receiver_catch_up": (ctypes.c_int, [P, P, ctypes.c_int32, ctypes.c_uint64]),
        "dte_push_receiver_get_status": (ctypes.c_int, [P, ctypes.POINTER(PushReceiverStatus),
                                                        ctypes.POINTER(ctypes.c_char_p)]),
        "dte_live_apply_version": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint64,
                                                  ctypes.POINTER(LiveCounts)]),
        "dte_live_get_status": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(LiveStatus)]),
        "dte_live_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(P)]),
        "dte_live_register_buffer": (ctypes.c_int, [P, ctypes.POINTER(LiveRegister)]),
        "dte_live_unregister": (ctypes.c_int, [P, ctypes.c_uint64]),
        "dte_live_prepare": (ctypes.c_int, [P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint32),
                                             ctypes.POINTER(LiveCounts)]),
        "dte_live_commit": (ctypes.c_int, [P, ctypes.c_uint32, ctypes.POINTER(LiveCounts)]),
        "dte_live_abort": (ctypes.c_int, [P, ctypes.c_uint32]),
        "dte_live_close": (ctypes.c_int, [P]),
    }


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    sigs = {**_publish_signatures(), **_push_signatures()}
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    if lib.dte_c_api_version() != C_API_VERSION:
        raise ImportError("dte: libdte.so speaks C API version %d, this module version %d"
                          % (lib.dte_c_api_version(), C_API_VERSION))
    return lib


lib = _declare(_load())
