/* The live-apply control interface of a dtefs mount: ioctl commands on the
 * file MOUNT/.dte/control and their fixed-size structs (docs/live.md).
 *
 * FUSE passes only "restricted" ioctls to a filesystem: the command number
 * must encode the direction and size of its argument, which the kernel
 * copies in before and out after the request (at most 16383 bytes). Every
 * struct here is plain old data with explicit padding, the same on every
 * 64-bit Linux ABI, and starts with abi_version.
 *
 * Errors: a failed command returns -1 with errno set (EPERM: not root or the
 * mounting user; EBUSY: another apply is running; ENOTTY: unknown command;
 * EINVAL, ENOENT, EIO, ...). Commands with an `error`/`message` pair also
 * fill them in, since errno alone cannot name the version, file or tensor:
 * the kernel copies the struct out even when the command fails.
 *
 * Plain C (included by the daemon, dtectl, the C ABI and its bindings).
 */
#ifndef DTE_SYNC_LIVE_ABI_H_
#define DTE_SYNC_LIVE_ABI_H_

#include <linux/ioctl.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTE_LIVE_ABI_VERSION 4
#define DTE_LIVE_CONTROL_FILE ".dte/control" /* relative to the mount point */
#define DTE_LIVE_LATEST UINT64_MAX           /* dte_live_apply.version: the newest */
#define DTE_LIVE_MESSAGE_BYTES 1024
#define DTE_LIVE_NAME_BYTES 256
#define DTE_LIVE_MAX_DIMS 8
#define DTE_LIVE_SERVER_BYTES 64

/* Counts of one apply. */
typedef struct dte_live_counts {
  uint64_t from_version;    /* live version before */
  uint64_t to_version;      /* live version after (the target) */
  uint64_t entries;         /* changed elements in the union of the deltas between the two */
  uint64_t bytes;           /* bytes of element values written into registered buffers */
  uint64_t pages;           /* page-cache pages of live/ files replaced in place */
  uint64_t receivers;       /* receivers (open control files with buffers) written */
  uint64_t buffers;         /* registered buffers written */
  uint64_t elapsed_ns;      /* from the request to the reply */
  uint64_t decode_ns;       /* deciding the changed set, decoding and verifying it */
  uint64_t scatter_ns;      /* writing registered buffers */
  uint64_t pagecache_ns;    /* finding and replacing cached pages */
  uint64_t blocks;          /* changed blocks (a block: the store's unit of a tensor) */
  uint64_t compared_blocks; /* of them, read whole from both versions and compared, not
                               composed from delta entries (docs/live.md) */
} dte_live_counts;

/* dte_live_apply.flags (ABI 4): the two phases of an apply that a
 * coordinator drives over several mounts, for servers whose ranks register
 * on several hosts (docs/live.md, "Servers on several hosts"). PREPARE
 * decides and checks the changes of `version` and holds them for this open
 * control file, writing nothing, with no server completeness check;
 * `prepared` is set to its id. COMMIT writes the prepared apply `prepared`
 * (refused with ECANCELED if a server's registered ranks changed since);
 * ABORT forgets it. Closing the control file aborts it too. While one is
 * prepared, other applies and registrations fail with EBUSY. */
#define DTE_LIVE_APPLY_PREPARE 1u
#define DTE_LIVE_APPLY_COMMIT 2u
#define DTE_LIVE_APPLY_ABORT 4u

/* DTE_IOC_APPLY: make `version` the live version, everywhere, in place.
 * Returns when every registered buffer and every cached page of live/ holds
 * the target version. */
typedef struct dte_live_apply {
  uint32_t abi_version; /* in: DTE_LIVE_ABI_VERSION */
  uint32_t flags;       /* in: 0 (one apply), or one DTE_LIVE_APPLY_* phase */
  uint64_t version;     /* in: target version, or DTE_LIVE_LATEST (0 or PREPARE) */
  int32_t error;        /* out: 0 or an errno value */
  uint32_t prepared;    /* out (PREPARE): the prepared apply's id; in (COMMIT, ABORT) */
  dte_live_counts counts;               /* out */
  char message[DTE_LIVE_MESSAGE_BYTES]; /* out: why it failed, NUL-terminated */
} dte_live_apply;

/* DTE_IOC_STATUS: the live state. */
typedef struct dte_live_status {
  uint32_t abi_version;    /* in: DTE_LIVE_ABI_VERSION */
  uint32_t applying;       /* out: 1 while an apply runs */
  uint64_t live_version;   /* out: DTE_LIVE_LATEST when there is none yet */
  uint64_t latest_version; /* out: DTE_LIVE_LATEST when the store is empty */
  uint64_t receivers;      /* out: open control files with registered buffers */
  uint64_t buffers;        /* out: registered buffers */
  uint64_t applies;        /* out: applies completed since mount */
  uint64_t failed_applies; /* out */
  int64_t last_apply_time; /* out: seconds since the epoch of the last apply; 0: none */
  int32_t last_error;      /* out: errno of the last apply (0: it succeeded) */
  uint32_t prepared;       /* out (ABI 4): id of the prepared apply held, 0: none */
  dte_live_counts last;                      /* out: counts of the last successful apply */
  char last_message[DTE_LIVE_MESSAGE_BYTES]; /* out: the last failure's message */
} dte_live_status;

enum dte_live_buffer_kind {
  DTE_LIVE_HOST_SHM = 0, /* a region of a /dev/shm object */
  DTE_LIVE_CUDA_IPC = 1, /* GPU memory exported with cudaIpcGetMemHandle */
};

/* How an FP8 receiver's block scales follow from each block's absolute
 * maximum (kernels/fp8_math.h, docs/fp8.md). */
enum dte_live_fp8_scale_rule {
  DTE_LIVE_FP8_PLAIN = 0, /* amax / 448 */
  DTE_LIVE_FP8_POW2 = 1,  /* amax / 448 rounded up to a power of two */
};

/* DTE_IOC_REGISTER: one weight buffer of a receiver. The receiver is the
 * open control file: every buffer registered through it shares its layout
 * and is unregistered when it is closed (the process exits). */
typedef struct dte_live_register {
  uint32_t abi_version; /* in: DTE_LIVE_ABI_VERSION */
  uint32_t kind;        /* in: enum dte_live_buffer_kind */
  /* The receiver's layout (sync/transfer/transfer_plan.h ShardLayout). */
  int32_t tp;            /* in: tensor-parallel degree, >= 1 */
  int32_t rank;          /* in: 0 .. tp-1 */
  uint32_t fuse_qkv;     /* in: 1: q/k/v held as one qkv_proj */
  uint32_t fuse_gate_up; /* in: 1: gate/up held as one gate_up_proj */
  /* The tensor, by its name in the receiver layout (for example
   * model.layers.0.self_attn.qkv_proj.weight), dtype and rank-local shape. */
  char name[DTE_LIVE_NAME_BYTES]; /* in */
  char dtype[8];                  /* in: safetensors name, "BF16" */
  uint32_t ndim;                  /* in */
  /* in: the receiver's FP8 block (block x block elements, one F32 scale
   * each; 0: 128), the same in every registration of a receiver. An FP8
   * receiver registers its quantized tensors with dtype "F8_E4M3" and their
   * scales as "<module>.weight_scale_inv" (F32, the block grid of the
   * rank-local tensor); docs/live.md, "FP8 receivers". */
  uint32_t fp8_block;
  int64_t shape[DTE_LIVE_MAX_DIMS]; /* in */
  /* DTE_LIVE_HOST_SHM: the object's name under /dev/shm (no '/'), owned by
   * the caller, and the byte offset of the tensor in it. */
  char shm_name[DTE_LIVE_NAME_BYTES]; /* in */
  uint64_t offset;                    /* in */
  /* DTE_LIVE_CUDA_IPC: the cudaIpcMemHandle_t bytes and the device; the
   * tensor starts `offset` bytes into the allocation the handle names (a
   * caching allocator's block holds many tensors). */
  uint8_t cuda_ipc_handle[64]; /* in */
  int32_t cuda_device;         /* in */
  uint32_t fp8_scale_rule;     /* in: enum dte_live_fp8_scale_rule, as fp8_block */
  uint64_t buffer_id;          /* out: for DTE_IOC_UNREGISTER */
  int32_t error;               /* out: 0 or an errno value */
  uint32_t reserved2;
  char message[DTE_LIVE_MESSAGE_BYTES]; /* out */
  /* in: the version the buffer holds now. An apply adds each change to what
   * the buffer holds, so it must hold the live version: registration fails
   * with EINVAL if the live version is another one (an apply came between
   * loading and registering), and with EBUSY while an apply runs.
   * DTE_LIVE_LATEST: not checked (the caller vouches for it). */
  uint64_t version;
  /* in (ABI 3): the inference server this receiver is a rank of (its
   * `rank` is the server's rank) and the server's size, the same in every
   * registration of the server on this mount. An apply writes a server's
   * buffers only when each of its ranks 0 .. server_size-1 registered, and
   * is refused otherwise (docs/live.md, "Servers"). An empty name with a
   * size of 0 or 1: a receiver of no server, as in ABI 2. */
  char server[DTE_LIVE_SERVER_BYTES];
  int32_t server_size;
  uint32_t reserved3;
} dte_live_register;

#define DTE_IOC_MAGIC 0xD7
#define DTE_IOC_APPLY _IOWR(DTE_IOC_MAGIC, 1, dte_live_apply)
#define DTE_IOC_STATUS _IOWR(DTE_IOC_MAGIC, 2, dte_live_status)
#define DTE_IOC_REGISTER _IOWR(DTE_IOC_MAGIC, 3, dte_live_register)
/* The argument is the buffer_id to drop; 0 drops every buffer of this open
 * control file. */
#define DTE_IOC_UNREGISTER _IOW(DTE_IOC_MAGIC, 4, uint64_t)

#ifdef __cplusplus
} /* extern "C" */
static_assert(sizeof(dte_live_counts) == 104, "dte_live_counts layout");
static_assert(sizeof(dte_live_apply) == 24 + 104 + 1024, "dte_live_apply layout");
static_assert(sizeof(dte_live_register) % 8 == 0, "dte_live_register layout");
static_assert(sizeof(dte_live_register) <= 16383, "restricted FUSE ioctl size");
#endif

#endif /* DTE_SYNC_LIVE_ABI_H_ */
