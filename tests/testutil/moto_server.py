"""moto's S3 server for the tests: conditional writes made atomic, and an
optional mode that checks every request's SigV4 signature.

moto checks `If-None-Match: *` and then stores the object in two steps, so
on its threaded server two racing conditional PUTs can both succeed. S3 (and
MinIO, Ceph RGW) make the check and the write one step, and the "exactly one
creator wins" tests rely on that. This runs moto's own server (moto.server's
main, same arguments) with its WSGI application wrapped so that requests
carrying If-None-Match or If-Match are handled one at a time; nothing else
changes.

--check-signatures FILE: moto normally accepts any signature. With this
flag the server first creates, through its own IAM and STS APIs, a user with
an access key and an assumed-role session (temporary credentials with a
session token), both allowed everything, and the buckets named by --bucket;
then it turns on moto's request authentication (botocore recomputes every
request's SigV4 signature) and writes the credentials as JSON to FILE:
{"access_key", "secret_key", "session": {"access_key", "secret_key", "token"}}.
FILE appears only when the server is ready.

Also: Debian's awscli package brings python3-awscrt 0.16, which lacks the
CRC64NVME checksum moto computes for every completed multipart upload; with
such an awscrt, moto is told it has none and uses its own fallback.

Usage: python3 moto_server.py -H 127.0.0.1 -p PORT [--check-signatures FILE [--bucket B]...]
"""

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

import moto.s3.utils
import moto.server as server
import moto.settings

try:
    from awscrt import checksums as _crt_checksums

    if not hasattr(_crt_checksums, "crc64nvme"):
        moto.s3.utils.HAS_CRT = False
except ImportError:
    pass

_lock = threading.Lock()
_run_simple = server.run_simple
_ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


class _ConditionalWritesOneAtATime:
    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
            with _lock:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


def _run(host, port, app, **kwargs):
    _run_simple(host, port, _ConditionalWritesOneAtATime(app), **kwargs)


def _wait_until_serving(endpoint):
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)


def _set_up_signed(endpoint, creds_file, buckets):
    """Runs while the server starts: unauthenticated setup, then auth on."""
    try:
        import boto3

        _wait_until_serving(endpoint)
        kw = dict(endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id="setup", aws_secret_access_key="setup")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="dte-test")
        iam.put_user_policy(UserName="dte-test", PolicyName="all", PolicyDocument=_ALLOW_ALL)
        key = iam.create_access_key(UserName="dte-test")["AccessKey"]
        trust = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})
        role = iam.create_role(RoleName="dte-test", AssumeRolePolicyDocument=trust)["Role"]
        iam.put_role_policy(RoleName="dte-test", PolicyName="all", PolicyDocument=_ALLOW_ALL)
        session = boto3.client("sts", **kw).assume_role(
            RoleArn=role["Arn"], RoleSessionName="dte-test")["Credentials"]
        s3 = boto3.client("s3", **kw)
        for bucket in buckets:
            s3.create_bucket(Bucket=bucket)
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on, every request is checked
        creds = {"access_key": key["AccessKeyId"], "secret_key": key["SecretAccessKey"],
                 "session": {"access_key": session["AccessKeyId"],
                             "secret_key": session["SecretAccessKey"],
                             "token": session["SessionToken"]}}
        with open(creds_file + ".tmp", "w") as f:
            json.dump(creds, f)
        os.rename(creds_file + ".tmp", creds_file)
    except Exception as e:  # the test harness sees no FILE and the log says why
        print(f"moto_server.py: signed setup failed: {e!r}", file=sys.stderr, flush=True)
        os._exit(3)


def main(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--check-signatures", metavar="FILE")
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", default="5000")
    ours, rest = parser.parse_known_args(argv)
    server.run_simple = _run
    if ours.check_signatures:
        endpoint = f"http://{ours.host}:{ours.port}"
        threading.Thread(target=_set_up_signed, daemon=True,
                         args=(endpoint, ours.check_signatures, ours.bucket)).start()
    server.main(["-H", ours.host, "-p", str(ours.port), *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
