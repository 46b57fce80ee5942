/* The C ABI of dte's publisher and reader, for bindings (the Python module
 * dte uses it through ctypes) and C programs. Built into libdte.so.
 *
 * Conventions: every function returns DTE_OK (0) or a dte_code; on failure
 * dte_last_error() returns a message naming the store, version, tensor or
 * field involved, valid until the next failing call on the same thread.
 * Arrays are borrowed for the duration of the call only and must be
 * C-contiguous.
 *
 * Handles (dte_publisher, dte_store, dte_tensor_table, dte_transport,
 * dte_push_server, dte_push_receiver, dte_live) are
 * opaque tokens, not addresses: every call looks its handles up in the
 * library's table of open handles before using them. A NULL handle, a closed
 * one, one of another type or a value the library never gave is refused with
 * DTE_INVALID_ARGUMENT and a message "FUNCTION: expected a TYPE handle, got
 * ..." saying what it got; it is never dereferenced, and tokens are never
 * reused within a process. Close each handle once (dte_*_close returns
 * DTE_OK, or DTE_INVALID_ARGUMENT for a handle that is not open, a second
 * close included). A handle that another holds stays alive while held: a
 * push server or an exchange set on a publisher until it is unset or the
 * publisher is closed, a publisher until the transports dte_transport_store
 * made from it are closed.
 *
 * Thread-safety: a handle must be used by one thread at a time; different
 * handles may be used concurrently. The handle table is thread-safe: a close
 * that races with a call on the same handle makes later calls fail, and the
 * object is destroyed when the call in flight returns. dte_last_error is
 * per thread.
 */
#ifndef DTE_SYNC_C_API_H_
#define DTE_SYNC_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "sync/live/live_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 5: dte_*_close return a dte_code; handles are checked tokens; dte_dist_stats
 * gains the phase times and detect_device_bytes.
 * 6: a publish that finds another writer moved the store's latest version
 * returns DTE_ALREADY_EXISTS (was DTE_INVALID_ARGUMENT); a push or live
 * apply reads only the attention geometry of config.json.
 * 7: FP8 receivers: dte_push_receiver_open_fp8; dte_push_receiver_status
 * gains bytes (the bytes pushes wrote).
 * 8: dte_publisher_publish_weights and dte_publisher_weights_begin, _add and
 * _commit; dte_publish_result gains parent_bytes
 * and path.
 * 9: reading a store's versions: dte_store_list_versions,
 * dte_store_version_tensors and dte_safetensors_tensors (tensor tables,
 * dte_tensor_table_entries and _close), dte_dtype_width.
 * 10: the canonical error codes (docs/errors.md): DTE_FAILED_PRECONDITION,
 * DTE_ABORTED, DTE_DEADLINE_EXCEEDED and DTE_UNAVAILABLE, and
 * dte_code_transient. A timeout is DTE_DEADLINE_EXCEEDED (was DTE_IO_ERROR),
 * a push receiver that missed pushes DTE_FAILED_PRECONDITION (was
 * DTE_NOT_FOUND), an unreachable S3 endpoint or peer DTE_UNAVAILABLE (was
 * DTE_IO_ERROR); DTE_BUSY (6) is retired: a held cache index or a running
 * live apply is DTE_UNAVAILABLE.
 * 11: one publisher handle for any number of ranks.
 * dte_dist_publisher and its dte_dist_publisher_* functions are gone: open
 * a dte_publisher (dte_publisher_open, _open_mcore), give it its rank, world
 * and their exchange with dte_publisher_set_group (a world of one, the
 * default, needs none), and call dte_publisher_publish_ranges (was
 * dte_dist_publisher_publish_adamw; its transport is now the group's
 * exchange), dte_publisher_last_stats and dte_publisher_share_push (no
 * transport argument either). set_anchor_policy, set_join_budget, set_push,
 * last_push_json and the metrics calls were dte_publisher_* already.
 * dte_publisher_publish_adamw and _publish_adamw_mcore work in a world of
 * several ranks too (each tensor or shard given is the rank's whole copy);
 * import and the weights calls need a world of one. dte_transport_store
 * takes a dte_publisher.
 * 12: inference servers (docs/push.md "Servers"): dte_push_receiver_open_server
 * (a receiver that is a rank of a named server, with its stage budget),
 * dte_push_receiver_path, _apply_agreed, _move_to and _server_status;
 * dte_push_receiver_status gains staged_bytes.
 * 13: dte_live_register (live ABI 3) gains server and server_size: a live
 * receiver that is a rank of an inference server (docs/live.md "Servers").
 * 14: live ABI 4: the two phases of an apply over several mounts
 * (docs/live.md "Servers on several hosts"): dte_live_prepare, _commit and
 * _abort on a dte_live; dte_live_status gains `prepared`. */
#define DTE_C_API_VERSION 14

/* Result codes, after Abseil's canonical codes (docs/errors.md). The values
 * are stable: new codes are appended, a retired one keeps its number unused. */
enum dte_code {
  DTE_OK = 0,
  DTE_INVALID_ARGUMENT = 1,
  DTE_NOT_FOUND = 2,
  DTE_ALREADY_EXISTS = 3, /* a racing publisher committed the version, or moved latest, first */
  DTE_CORRUPTION = 4,     /* data loss: stored bytes do not match their hash or grammar */
  DTE_IO_ERROR = 5,
  /* 6: reserved, was DTE_BUSY (retired in C API 10; now DTE_UNAVAILABLE) */
  DTE_UNIMPLEMENTED = 7,
  DTE_INTERNAL = 8,
  DTE_PERMISSION_DENIED = 9,    /* the store or the daemon refused the request */
  DTE_FAILED_PRECONDITION = 10, /* the state is wrong for the call (a receiver that missed
                                   pushes: catch up first) */
  DTE_ABORTED = 11,             /* a concurrency conflict (a round abandoned): retry the call */
  DTE_DEADLINE_EXCEEDED = 12,   /* a timeout */
  DTE_UNAVAILABLE = 13,         /* a peer, store or lock is unreachable for now: retry */
};

/* Element types of arrays passed in. */
enum dte_dtype {
  DTE_DTYPE_F32 = 0,
  DTE_DTYPE_BF16 = 1,
  DTE_DTYPE_F16 = 2,
  DTE_DTYPE_F64 = 3,
  DTE_DTYPE_OTHER = 255,
};

/* Which PyTorch kernel produced the update (kernels/adamw_math.h AdamWOrder;
 * docs/engine.md "Fused AdamW"). torch.optim.AdamW with amsgrad=False,
 * maximize=False on FP32 parameters:
 *   0 DTE_ORDER_TORCH_CPU                CPU tensors: foreach False or True, and
 *                                        fused=True (the same FP32 operations)
 *   1 DTE_ORDER_TORCH_CUDA_FOREACH       CUDA tensors, foreach=True (the default)
 *   2 DTE_ORDER_TORCH_CUDA_SINGLE_TENSOR CUDA tensors, foreach=False
 *   3 DTE_ORDER_TORCH_CUDA_FUSED         CUDA tensors, fused=True, torch 2.4 to 2.10
 *                                        (capturable or not; lr a float or a tensor,
 *                                        whose value is then given as lr)
 *   4 DTE_ORDER_TORCH_CUDA_FUSED_FP32    CUDA tensors, fused=True, torch 2.11 and later
 * Other values are refused with DTE_INVALID_ARGUMENT. */
enum dte_adamw_order {
  DTE_ORDER_TORCH_CPU = 0,
  DTE_ORDER_TORCH_CUDA_FOREACH = 1,
  DTE_ORDER_TORCH_CUDA_SINGLE_TENSOR = 2,
  DTE_ORDER_TORCH_CUDA_FUSED = 3,
  DTE_ORDER_TORCH_CUDA_FUSED_FP32 = 4,
};

typedef struct dte_publisher dte_publisher;
typedef struct dte_store dte_store;

typedef struct dte_array {
  const void* data;
  int32_t dtype; /* enum dte_dtype */
  int32_t ndim;
  const int64_t* shape; /* ndim entries */
} dte_array;

typedef struct dte_adamw_param {
  const char* name;
  dte_array param;      /* FP32 master weights after the step */
  dte_array exp_avg;    /* optimizer state exp_avg after the step */
  dte_array exp_avg_sq; /* optimizer state exp_avg_sq after the step */
  int64_t state_step;   /* optimizer state step, or -1 when unknown */
  double lr;            /* this tensor's param group lr; NaN: the step's */
  double weight_decay;  /* this tensor's param group weight decay; NaN: the step's */
} dte_adamw_param;

typedef struct dte_adamw_step {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;
  int32_t amsgrad, maximize; /* non-zero is rejected */
  int32_t order;             /* enum dte_adamw_order */
} dte_adamw_step;

/* Megatron-Core layout options (sync/convert/convert.h ParallelLayout). */
enum dte_mcore_norms { DTE_MCORE_NORMS_TE = 0, DTE_MCORE_NORMS_LOCAL = 1 };
enum dte_mcore_experts { DTE_MCORE_EXPERTS_SEQUENTIAL = 0, DTE_MCORE_EXPERTS_GROUPED = 1 };

typedef struct dte_mcore_layout {
  int32_t tp, ep;
  int32_t etp;                /* expert tensor parallelism; 0: tp */
  int64_t vocab_divisible_by; /* 0: 128, Megatron's default */
  int32_t norms;              /* enum dte_mcore_norms */
  int32_t experts;            /* enum dte_mcore_experts */
} dte_mcore_layout;

/* One Megatron-Core shard's optimizer state: parameter `name` as the rank
 * (tp_rank, ep_rank) holds it. */
typedef struct dte_mcore_adamw_shard {
  const char* name;
  int32_t tp_rank, ep_rank;
  dte_array param;      /* FP32 master weights of the shard after the step */
  dte_array exp_avg;    /* optimizer state exp_avg of the shard */
  dte_array exp_avg_sq; /* optimizer state exp_avg_sq of the shard */
  int64_t state_step;   /* optimizer state step, or -1 when unknown */
  double lr;            /* the shard's param group lr; NaN: the step's */
  double weight_decay;  /* the shard's param group weight decay; NaN: the step's */
} dte_mcore_adamw_shard;

typedef struct dte_publish_result {
  uint64_t version, parent, tensors, elements;
  uint64_t changed, flagged, false_positives, uncertain;
  uint64_t stored_bytes, state_bytes;
  uint64_t parent_bytes; /* parent version bytes read (dte_publisher_publish_weights) */
  int32_t path;          /* enum dte_publish_path */
} dte_publish_result;

/* How a publish found its changes. */
enum dte_publish_path {
  DTE_PATH_ADAMW = 0,   /* the AdamW step inverted from the optimizer state */
  DTE_PATH_WEIGHTS = 1, /* the new weights compared with the parent version */
};

/* One tensor's new weights for dte_publisher_publish_weights. */
typedef struct dte_weights_tensor {
  const char* name;
  dte_array weights; /* BF16 or F32 (cast to BF16, round to nearest even) */
} dte_weights_tensor;

const char* dte_last_error(void);
int dte_c_api_version(void);
/* 1 if a call that failed with `code` is worth retrying unchanged after a wait
 * (DTE_UNAVAILABLE, DTE_DEADLINE_EXCEEDED, DTE_ABORTED), else 0. */
int dte_code_transient(int code);

/* store: a local directory or s3://bucket/prefix; cache_dir may be NULL or
 * ""; converter NULL means "hf". */
int dte_publisher_open(const char* store, const char* cache_dir, const char* converter,
                       dte_publisher** out);
int dte_publisher_close(dte_publisher* p);
int dte_publisher_import(dte_publisher* p, const char* dir, uint64_t* version_out);
/* The anchor policy of later publishes (store/write/anchor_policy.h): a version
 * also carries a full table once the deltas since the last full one add up
 * to budget times the model's dense size (0: never), or once `every`
 * versions have passed (0: never). Default 1.0 and 0. */
int dte_publisher_set_anchor_policy(dte_publisher* p, double budget, uint64_t every);
/* Join tables of later publishes (store/write/anchor_policy.h, join_budget): a
 * version gets one once the deltas since the last full or join table add
 * up to join_budget times the dense size (0: never). Default 0.125. */
int dte_publisher_set_join_budget(dte_publisher* p, double join_budget);
int dte_publisher_publish_adamw(dte_publisher* p, const dte_adamw_step* step,
                                const dte_adamw_param* params, size_t count,
                                dte_publish_result* out);
/* Publishes new BF16 weights from any optimizer (or none): each tensor
 * given is compared with the latest version's, read from this host's
 * snapshots or the store, and only its changed elements are stored; tensors
 * not given are unchanged. step: the trainer's step, checked to follow the
 * last one this publisher published (-1: not checked). */
int dte_publisher_publish_weights(dte_publisher* p, int64_t step, const dte_weights_tensor* tensors,
                                  size_t count, dte_publish_result* out);
/* The same one tensor at a time: begin, add each tensor (its array may be
 * freed once add returns), commit. A failed add, or a begin before the
 * commit, drops the version being built; nothing reaches the store before
 * the commit. */
int dte_publisher_weights_begin(dte_publisher* p, int64_t step);
int dte_publisher_weights_add(dte_publisher* p, const dte_weights_tensor* tensor);
int dte_publisher_weights_commit(dte_publisher* p, dte_publish_result* out);

/* A publisher with the Megatron-Core converter: config_json is the text of
 * the model's Hugging Face config.json (llama, qwen3, qwen3_moe),
 * config_file names it in errors (may be NULL). Both publish calls work on
 * it; publish_adamw_mcore takes every shard of each converter unit it
 * publishes (units not given are unchanged) and commits exactly the version
 * dte_publisher_publish_adamw of the converted HF state would. */
int dte_publisher_open_mcore(const char* store, const char* cache_dir, const char* config_json,
                             const char* config_file, const dte_mcore_layout* layout,
                             dte_publisher** out);
int dte_publisher_publish_adamw_mcore(dte_publisher* p, const dte_adamw_step* step,
                                      const dte_mcore_adamw_shard* shards, size_t count,
                                      dte_publish_result* out);

/* Publishing from several ranks (sync/publish/publisher.h): every rank of a
 * sharded trainer publishes the optimizer state it holds, over an exchange
 * between the ranks (a dte_transport), and one version is committed when
 * every rank's part is in. A world of one is the simplest case: no
 * exchange. */
typedef struct dte_transport dte_transport;

/* The project's TCP transport: every one of `size` ranks calls it with the
 * same fresh directory (on storage every rank sees); timeout_ms bounds
 * connecting and every exchange. secret: the job secret every connection
 * proves (NULL or "": DTE_JOB_SECRET, DTE_JOB_SECRET_FILE, else the
 * directory's "secret" file, which rank 0 creates when there is none;
 * sync/transport/job_secret.h). */
int dte_transport_tcp(int32_t rank, int32_t size, const char* rendezvous_dir, int64_t timeout_ms,
                      const char* secret, dte_transport** out);

/* A transport through the publisher's store alone (ranks on hosts that
 * share nothing else): messages are objects under exchange/<job>/ of the
 * store (docs/formats/store-layout.md); every rank passes the same job, fresh
 * for each attempt. */
int dte_transport_store(dte_publisher* p, int32_t rank, int32_t size, const char* job,
                        int64_t timeout_ms, dte_transport** out);

/* One message of an exchange. */
typedef struct dte_message {
  int32_t peer;
  void* data; /* const for sends */
  uint64_t bytes;
} dte_message;

/* Runs one exchange: posts every send and receive (a rank may send to
 * itself; messages between a pair match in posting order) and returns 0
 * when all are done, or non-zero after writing a message naming the peer
 * into error (error_size bytes, NUL-terminated). */
typedef int (*dte_exchange_fn)(void* ctx, const dte_message* sends, size_t n_sends,
                               const dte_message* recvs, size_t n_recvs, char* error,
                               size_t error_size);

/* A transport whose exchanges the caller runs, for example over a
 * torch.distributed process group. fn and ctx must outlive the transport. */
int dte_transport_callback(int32_t rank, int32_t size, dte_exchange_fn fn, void* ctx,
                           dte_transport** out);
int dte_transport_close(dte_transport* t);

/* Where a range's arrays are. With DTE_MEMORY_CUDA the changes are found on
 * that device and only the changed elements are copied to the host; the
 * arrays must be ready (the caller's stream synchronized). */
enum dte_memory { DTE_MEMORY_HOST = 0, DTE_MEMORY_CUDA = 1 };

/* Elements [begin, end) of a tensor flattened in row-major order, as FP32
 * arrays of end - begin elements: of the Hugging Face tensor `name`, or with
 * the mcore converter of the Megatron-Core shard (name, tp_rank, ep_rank). */
typedef struct dte_adamw_range {
  const char* name;
  int32_t tp_rank, ep_rank;
  uint64_t begin, end;
  const float* param;
  const float* exp_avg;
  const float* exp_avg_sq;
  int64_t state_step;  /* -1 when unknown */
  double lr;           /* NaN: the step's */
  double weight_decay; /* NaN: the step's */
  int32_t memory;      /* enum dte_memory: where param, exp_avg and exp_avg_sq are */
  int32_t device;      /* with DTE_MEMORY_CUDA: the CUDA device ordinal */
} dte_adamw_range;

/* What the last dte_publisher_publish_ranges did on this rank
 * (sync/publish/publisher.h, DistPublishStats). */
typedef struct dte_dist_stats {
  uint64_t entries_sent;           /* changed-element entries routed, to itself included */
  uint64_t bytes_sent;             /* payload bytes sent to other ranks */
  uint64_t bytes_received;         /* payload bytes received from them */
  uint64_t tensors_owned;          /* tensors this rank encoded */
  uint64_t parent_bytes_read;      /* parent block bytes read to encode them */
  uint64_t messages_sent;          /* messages to other ranks */
  uint64_t push_tensors_kept;      /* pushing what it owns: tensors pushed from memory */
  uint64_t push_tensors_read_back; /* and tensors read back from the store */
  uint64_t detect_ns;              /* detection (host screen, or device kernel and copy back) */
  uint64_t encode_ns;              /* encoding the tensors this rank owned */
  uint64_t commit_ns;              /* its part sent to rank 0 until the outcome (the commit) */
  uint64_t detect_device_bytes;    /* bytes detection copied from device to host */
} dte_dist_stats;

/* The ranks p publishes with (PublisherOptions::group): rank `rank` of
 * `world`, exchanging over `exchange`, which p holds until it is set again or
 * p is closed. world 1 (the default) needs no exchange (NULL); a larger
 * world needs one before its publishes, of the same rank and size. Set it
 * again with a new transport to retry after one failed. */
int dte_publisher_set_group(dte_publisher* p, int32_t rank, int32_t world, dte_transport* exchange);
/* Publishes the state this rank holds, as ranges (of Hugging Face tensors,
 * or with the mcore converter of Megatron-Core shards). Every rank of the
 * group calls it with the same step; each returns the same committed
 * version, or fails. A failed exchange stays failed: set a new one to retry
 * the step. */
int dte_publisher_publish_ranges(dte_publisher* p, const dte_adamw_step* step,
                                 const dte_adamw_range* ranges, size_t count,
                                 dte_publish_result* out);
int dte_publisher_last_stats(dte_publisher* p, dte_dist_stats* out);

/* Same-cluster push (sync/push/push_server.h, docs/push.md). A push server runs on the
 * trainer; after each publish of a publisher it is set on, the version's
 * changed elements go to every receiver that holds the parent version.
 * Strings returned through `const char**` stay valid until the next call on
 * the same handle. */
typedef struct dte_push_server dte_push_server;
typedef struct dte_push_receiver dte_push_receiver;
/* address "HOST:PORT" to listen on (port 0: any free port); advertise: the
 * host receivers reach it at (NULL or "": the listen host, or the host name
 * when listening on every interface); timeout_ms bounds each push and each
 * new receiver's hello; receivers: the receiver ranks expected (0: not
 * said; each push reports those it missed); cache_bytes: PushServerOptions'
 * (negative: its default, 256 MiB); secret: the job secret every connection
 * must prove (NULL or "": DTE_JOB_SECRET, DTE_JOB_SECRET_FILE, else
 * rendezvous_dir's "secret" file when rendezvous_dir is set). Without a
 * secret only a loopback address is accepted (DTE_INVALID_ARGUMENT). */
int dte_push_server_start(const char* address, const char* advertise, int64_t timeout_ms,
                          int64_t receivers, int64_t cache_bytes, const char* secret,
                          const char* rendezvous_dir, dte_push_server** out);
int dte_push_server_close(dte_push_server* s);
int dte_push_server_port(dte_push_server* s, int32_t* port_out);
/* PushServer::address(): "HOST:PORT" receivers reach it at. */
int dte_push_server_address(dte_push_server* s, const char** address_out);
/* PushServer::SetGroup: this server sends part `part` of `parts` of each
 * push (a publisher's rank of several; the publisher sets it again at each
 * publish). */
int dte_push_server_set_group(dte_push_server* s, int32_t part, int32_t parts);
/* PushServer::StatusJson: receivers and (take_events != 0) the events
 * since the last call that took them. */
int dte_push_server_status_json(dte_push_server* s, int32_t take_events, const char** json_out);
/* Push after each successful publish of p (s NULL: stop). p holds the
 * server until it is unset or p is closed. With several ranks
 * (Publisher::SetPush): on rank 0 only, which pushes every tensor read back
 * from the store, or on every rank, each pushing the tensors it owns. */
int dte_publisher_set_push(dte_publisher* p, dte_push_server* s);
/* The push of p's last publish: PushReportJson, {"error": "..."} when it
 * could not run, or "null" without a push server. */
int dte_publisher_last_push_json(dte_publisher* p, const char** json_out);
/* Publisher::SharePush: every rank together, after set_push (or with no
 * push server) and set_group: rank 0's server learns every rank's before the
 * first publish. */
int dte_publisher_share_push(dte_publisher* p);

/* Publisher metrics (sync/publish/publish_metrics.h; names and meanings in
 * docs/engine.md, "Metrics"): what p's publishes did, as Prometheus metrics.
 * The exposition text, valid until the next metrics call on p: */
int dte_publisher_metrics_text(dte_publisher* p, const char** text_out);
/* Serve them at http://ADDRESS/metrics until the next call or close:
 * address "HOST:PORT", or "PORT" alone for loopback (port 0: any free port;
 * "": stop). *port_out (may be NULL) gets the port. */
int dte_publisher_serve_metrics(dte_publisher* p, const char* address, int32_t* port_out);
/* Push their current values to the Pushgateway at `gateway` ("http://HOST:PORT"
 * or "HOST:PORT") as job `job`, grouped by the label_count labels
 * label_names[i]=label_values[i] (e.g. rank), replacing that group's values. */
int dte_publisher_push_metrics(dte_publisher* p, const char* gateway, const char* job,
                               const char* const* label_names, const char* const* label_values,
                               size_t label_count);

/* One tensor of a receiver, in its own layout, in host or CUDA device
 * memory. dtype is a safetensors name ("BF16", "F32", ...). */
typedef struct dte_push_tensor {
  const char* name;
  const char* dtype;
  int32_t ndim;
  const int64_t* shape;
  void* data;
  int32_t device; /* -1: host memory; else the CUDA device `data` is on */
} dte_push_tensor;

typedef struct dte_push_receiver_status {
  int32_t has_version; /* 0: unknown, or inconsistent */
  uint64_t version;
  int32_t inconsistent; /* a catch-up failed part way */
  int32_t connected;
  int32_t has_behind; /* the server said it is at `behind`: catch up */
  uint64_t behind;
  uint64_t pending, pushes, elements;
  uint64_t bytes;        /* bytes the pushes wrote (elements times their width) */
  uint64_t staged_bytes; /* memory of the pushes and moves staged, not applied */
} dte_push_receiver_status;

/* Starts a receiver: rank `rank` of a layout of degree tp (fuse_* nonzero:
 * vLLM/SGLang fused qkv_proj / gate_up_proj); has_version nonzero: the
 * tensors hold `version`. auto_apply nonzero: pushes are written as they
 * arrive, on the receiver's thread. secret: the job secret (NULL or "":
 * from the environment, as the server's); the receiver proves it to every
 * server and takes nothing from one that does not prove it back. */
int dte_push_receiver_open(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                           int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                           const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                           int64_t timeout_ms, const char* secret, dte_push_receiver** out);
/* How an FP8 push receiver's block scales follow from each block's absolute
 * maximum (kernels/fp8_math.h, docs/fp8.md). */
enum dte_push_fp8_scale_rule {
  DTE_PUSH_FP8_PLAIN = 0, /* amax / 448 */
  DTE_PUSH_FP8_POW2 = 1,  /* amax / 448 rounded up to a power of two */
};
/* The same for an FP8 receiver (docs/push.md, "FP8 receivers"): the
 * tensors the default FP8 policy quantizes are given as "F8_E4M3" tensors
 * with an "F32" "<module>.weight_scale_inv" each (the block grid of the
 * rank-local tensor), blocks of fp8_block_rows x fp8_block_cols (0: 128),
 * scales by fp8_scale_rule (enum dte_push_fp8_scale_rule). Pushes write the
 * E4M3 bytes and scales that changed; a catch-up quantizes the version. */
int dte_push_receiver_open_fp8(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                               int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                               const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                               int64_t timeout_ms, const char* secret, uint64_t fp8_block_rows,
                               uint64_t fp8_block_cols, int32_t fp8_scale_rule,
                               dte_push_receiver** out);
/* Either of the above (fp8 nonzero: an FP8 receiver), and a rank of the
 * inference server named `server` of server_size ranks (NULL or "": none,
 * server_size 1): such a rank applies only what every rank of its server
 * staged (dte_push_receiver_apply_agreed), never with auto_apply.
 * stage_bytes: the most bytes of pushes and moves staged (0: 4 GiB). */
int dte_push_receiver_open_server(const char* address, int32_t rank, int32_t tp, int32_t fuse_qkv,
                                  int32_t fuse_gate_up, int32_t has_version, uint64_t version,
                                  const dte_push_tensor* tensors, size_t count, int32_t auto_apply,
                                  int64_t timeout_ms, const char* secret, int32_t fp8,
                                  uint64_t fp8_block_rows, uint64_t fp8_block_cols,
                                  int32_t fp8_scale_rule, const char* server, int32_t server_size,
                                  uint64_t stage_bytes, dte_push_receiver** out);
int dte_push_receiver_close(dte_push_receiver* r);
/* DTE_FAILED_PRECONDITION on a rank of a server of several ranks. */
int dte_push_receiver_apply_pending(dte_push_receiver* r, uint64_t* applied_out);
/* DTE_OK once the tensors hold `version` or newer (a rank of a server:
 * once `version` is staged); DTE_FAILED_PRECONDITION when the receiver
 * missed pushes (catch up), DTE_DEADLINE_EXCEEDED on timeout. */
int dte_push_receiver_wait_for(dte_push_receiver* r, uint64_t version, int64_t timeout_ms);
/* Copies `version` (has_version 0: the one the server said) from the store
 * into the tensors and tells the server; a rank of a server that knows the
 * version it holds stages it instead (as dte_push_receiver_move_to). */
int dte_push_receiver_catch_up(dte_push_receiver* r, dte_store* s, int32_t has_version,
                               uint64_t version);
/* Stages the move to `version` from the last version held or staged,
 * either direction along one chain of the store: the elements that differ,
 * from the store's deltas; applied like a push. */
int dte_push_receiver_move_to(dte_push_receiver* r, dte_store* s, uint64_t version);
/* The versions the receiver can be at without the store: the one it holds,
 * then each staged one. Writes at most cap to out; *n_out: how many there
 * are (0: the version held is unknown). */
int dte_push_receiver_path(dte_push_receiver* r, uint64_t* out, size_t cap, size_t* n_out);
/* A rank of a server: applies up to the version every rank's path holds
 * (the furthest along rank 0's), given every rank's path, concatenated in
 * `versions` with lengths[i] entries for rank i of `ranks` (the same on
 * every rank). With none in common nothing is written and *applied_out is
 * 0 (dte_push_receiver_server_status says why). */
int dte_push_receiver_apply_agreed(dte_push_receiver* r, const uint64_t* versions,
                                   const size_t* lengths, size_t ranks, uint64_t* applied_out);
/* What the server's ranks last agreed on: has_version and version, or
 * inconsistent with the reason in *error_out (may be NULL). */
int dte_push_receiver_server_status(dte_push_receiver* r, int32_t* has_version, uint64_t* version,
                                    int32_t* inconsistent, const char** error_out);
/* error_out (may be NULL): the last error ("" if none). */
int dte_push_receiver_get_status(dte_push_receiver* r, dte_push_receiver_status* out,
                                 const char** error_out);

/* Reading versions: what the Python module's StoreReader and Follower
 * read a store through (a local directory or s3://bucket/prefix, with the
 * S3 settings of docs/s3.md), as dtectl and dtefs read it (store/store.h).
 * Listings are checked (docs/s3.md, "Listings are checked"): one that
 * lacks a version whose manifest exists when read directly, or names one
 * that does not exist, is never believed. */
int dte_store_open(const char* store, const char* cache_dir, dte_store** out);
int dte_store_close(dte_store* s);
/* The newest committed version (Store::Latest); *has_version_out = 0 for an
 * empty store. Within one handle it never goes back while that version's
 * manifest exists: a listing that lacks it is made again, and the version
 * leaves only once its manifest is gone when read directly, as a dtefs
 * mount's `latest`. */
int dte_store_latest(dte_store* s, int* has_version_out, uint64_t* version_out);
/* The committed versions (Store::ListCommitted), increasing; with
 * has_after non-zero only those after `after`. *versions_out points at
 * *count_out of them, valid until the next call on s. The listing passed
 * the checks above and its newest version's manifest was read directly:
 * that newest is what dte_store_latest answers. */
int dte_store_list_versions(dte_store* s, int32_t has_after, uint64_t after,
                            const uint64_t** versions_out, size_t* count_out);
/* The bytes of tensor `name` at `version` (as stored, e.g. BF16), checked
 * against the version's block hashes and the tensor hash; `bytes` must be
 * the tensor's exact size. */
int dte_store_read_tensor(dte_store* s, uint64_t version, const char* name, void* dst,
                          uint64_t bytes);

/* Tensor tables: the tensors of a version, or of one safetensors file, as
 * the store's own parsers read them (the manifest, store/manifest.h; a
 * file's header, store/safetensors.h). */
typedef struct dte_tensor_table dte_tensor_table;
typedef struct dte_tensor_info {
  const char* name;
  const char* dtype; /* safetensors name: "BF16", "F32", "F8_E4M3", ... */
  int32_t ndim;
  const int64_t* shape; /* ndim entries */
  uint64_t bytes;
  const char* file; /* the safetensors file holding it (a plain file name) */
  uint64_t offset;  /* of its first byte in that file */
  const char* hash; /* XXH3-128 of its bytes, 32 hex digits; "" where not known */
} dte_tensor_info;
/* The tensors of committed `version` of s, from its manifest (hashes
 * included), in file order; DTE_NOT_FOUND naming the version when it is not
 * committed. */
int dte_store_version_tensors(dte_store* s, uint64_t version, dte_tensor_table** out);
/* The tensors of the safetensors file at `path` (a version's file on a dtefs
 * mount, say), from its header, validated as an import validates it (no
 * hashes: a header has none). */
int dte_safetensors_tensors(const char* path, dte_tensor_table** out);
/* *entries_out points at the table's *count_out tensors, valid until it is
 * closed. */
int dte_tensor_table_entries(dte_tensor_table* t, const dte_tensor_info** entries_out,
                             size_t* count_out);
int dte_tensor_table_close(dte_tensor_table* t);
/* Bytes per element of safetensors dtype `dtype` (1, 2, 4 or 8);
 * DTE_INVALID_ARGUMENT naming it for a dtype dte does not know. */
int dte_dtype_width(const char* dtype, int32_t* width_out);

/* Live apply (docs/live.md): ioctls on MOUNT/.dte/control of a dtefs mount
 * (sync/live/live_abi.h). Errors name the mount; a path that is not a dtefs
 * mount with live apply fails with DTE_NOT_FOUND (no .dte/control) or
 * DTE_INVALID_ARGUMENT (ENOTTY); EPERM/EACCES give DTE_PERMISSION_DENIED,
 * EBUSY (another apply runs) DTE_UNAVAILABLE, ETIMEDOUT DTE_DEADLINE_EXCEEDED.
 *
 * (The functions cannot be named after the structs they take, such as
 * dte_live_apply and dte_live_status: C gives typedefs and functions one
 * namespace.) */

/* Makes `version` (DTE_LIVE_LATEST: the newest) the live version of the
 * mount, in place; returns when every registered buffer and cached page
 * holds it. `out` (may be NULL) receives the apply's counts. */
int dte_live_apply_version(const char* mount, uint64_t version, dte_live_counts* out);
/* The live state of the mount. */
int dte_live_get_status(const char* mount, dte_live_status* out);

/* A receiver: one open control file of a mount. Every buffer registered
 * through it is unregistered when it is closed (or the process exits). */
typedef struct dte_live dte_live;
int dte_live_open(const char* mount, dte_live** out);
/* Registers one weight buffer: fills inout->abi_version, and on return
 * inout->buffer_id (success) or inout->error and inout->message. Set
 * inout->version to the version the buffer holds (DTE_LIVE_LATEST: not
 * checked); a zeroed struct claims version 0. */
int dte_live_register_buffer(dte_live* l, dte_live_register* inout);
/* Drops buffer `id`; 0 drops every buffer of this receiver. */
int dte_live_unregister(dte_live* l, uint64_t id);
/* The two phases of an apply (live ABI 4): prepare decides and checks the
 * changes to `version` (DTE_LIVE_LATEST: the newest) and holds them for this
 * handle, writing nothing, and sets *prepared_out to the id commit and abort
 * take; closing the handle aborts it. Commit writes it (DTE_ABORTED with
 * nothing written if a server's registered ranks changed since). `out`
 * (may be NULL) receives the counts. */
int dte_live_prepare(dte_live* l, uint64_t version, uint32_t* prepared_out,
                     dte_live_counts* out);
int dte_live_commit(dte_live* l, uint32_t prepared, dte_live_counts* out);
int dte_live_abort(dte_live* l, uint32_t prepared);
int dte_live_close(dte_live* l);

#ifdef __cplusplus
}
#endif

#endif /* DTE_SYNC_C_API_H_ */
