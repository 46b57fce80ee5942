// The C ABI: the thread's last error and the ABI's version.
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"

using dte::capi::LastError;

const char* dte_last_error(void) { return LastError().c_str(); }

int dte_c_api_version(void) { return DTE_C_API_VERSION; }
