// The C ABI: the thread's last error, the ABI's version and which codes are transient.
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"

using dte::capi::LastError;

const char* dte_last_error(void) { return LastError().c_str(); }

int dte_c_api_version(void) { return DTE_C_API_VERSION; }

int dte_code_transient(int code) {
  return code == DTE_UNAVAILABLE || code == DTE_DEADLINE_EXCEEDED || code == DTE_ABORTED;
}
