"""Where a Follower reads versions from: a dtefs mount (MOUNT/latest,
MOUNT/vNNNNNNNN/*.safetensors, .dte/status) or a store URI (a local
directory or s3://, tensors read through StoreReader). Both answer the same
questions: the newest version, the versions listed, a version's tensor
layout (name, dtype, shape, XXH3-128 hash where the manifest is readable),
and a verified read of one tensor's bytes."""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os
import re
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from dte._errors import (Corrupt, DteError, InvalidArgument, IOFailure, NotFound,
                         PermissionDenied, Unimplemented)
from dte._reader import StoreReader

_T = TypeVar("_T")
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
_MANIFEST = re.compile(r"^v(\d{8,})(?:\.r\d+)?\.json$")
_WIDTH = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
          "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a version, as its manifest or safetensors header says."""
    name: str
    dtype: str               # a safetensors dtype name ("BF16", "F32", ...)
    shape: Tuple[int, ...]
    nbytes: int
    file: str                # the safetensors file holding it
    offset: int              # of its first byte in that file
    hash: Optional[str]      # XXH3-128, 32 hex digits; None: the manifest is not readable here


def version_name(version: int) -> str:
    return "v%08d" % version


def _element_bytes(name: str, dtype: str) -> int:
    try:
        return _WIDTH[dtype]
    except KeyError:
        raise InvalidArgument("tensor %s has dtype %r, which dte does not know" % (name, dtype))


def _count(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout_of_manifest(m: Any, what: str) -> Dict[str, TensorInfo]:
    """{name: TensorInfo} of a parsed manifest (docs/formats/manifest.md);
    `what` names it in errors."""
    try:
        return _tensor_infos(m)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise Corrupt("%s is not a manifest dte can read (%s: %s)"
                      % (what, type(e).__name__, e)) from None


def _tensor_infos(m: Any) -> Dict[str, TensorInfo]:
    out: Dict[str, TensorInfo] = {}
    for f in m.get("files", []):
        base = int(f.get("header_size", 0))
        for t in f.get("tensors", []):
            begin, end = (int(x) for x in t["offsets"])
            out[t["name"]] = TensorInfo(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]),
                                        end - begin, f["name"], base + begin, t.get("hash"))
    return out


def _s3_client() -> Any:
    """A boto3 S3 client configured from the environment dte reads
    (AWS_ENDPOINT_URL(_S3), AWS_REGION, the keys, the profile)."""
    try:
        boto3 = importlib.import_module("boto3")
    except ImportError:
        raise Unimplemented("reading the manifests of an s3:// store from Python needs boto3 "
                            "(pip install boto3); or follow a dtefs mount of it") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return boto3.client("s3", endpoint_url=endpoint)


def _s3_call(what: str, fn: Callable[[], _T]) -> _T:
    """fn(), its boto3 failure turned into the dte exception of its kind:
    the one place that converts them."""
    exc = importlib.import_module("botocore.exceptions")
    try:
        return fn()
    except exc.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        cls = {"NoSuchKey": NotFound, "NoSuchBucket": NotFound, "404": NotFound,
               "AccessDenied": PermissionDenied, "403": PermissionDenied}.get(code, IOFailure)
        raise cls("%s: %s" % (what, e)) from None
    except exc.BotoCoreError as e:
        raise IOFailure("%s: %s" % (what, e)) from None


class StoreSource:
    """A store URI: latest and tensors through StoreReader (verified against
    block and tensor hashes), listings and manifests read directly (a local
    directory, or s3:// through boto3). Not thread-safe."""

    def __init__(self, uri: str, cache_dir: Optional[str] = None) -> None:
        self.uri = uri
        self.reader = StoreReader(uri, cache_dir)
        self._s3: Optional[Tuple[Any, str, str]] = None
        self._layouts: Dict[int, Dict[str, TensorInfo]] = {}

    def describe(self) -> str:
        return "store %s" % self.uri

    def latest(self) -> Optional[int]:
        return self.reader.latest()

    def _bucket(self) -> Tuple[Any, str, str]:
        if self._s3 is None:
            rest = self.uri[len("s3://"):]
            bucket, _, prefix = rest.partition("/")
            prefix = prefix.strip("/")
            self._s3 = (_s3_client(), bucket, prefix + "/" if prefix else "")
        return self._s3

    def _manifest_names(self, begins: str = "v", start: str = "") -> List[str]:
        """Names of the manifest objects under manifests/ that begin with
        `begins`, listed after `start` (s3: only those are listed)."""
        if not self.uri.startswith("s3://"):
            return [os.path.basename(p) for p in
                    glob.glob(os.path.join(glob.escape(self.uri), "manifests", begins + "*"))
                    if p.endswith(".json")]
        client, bucket, prefix = self._bucket()

        def listing() -> List[str]:
            names: List[str] = []
            for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=prefix + "manifests/" + begins,
                    StartAfter=prefix + "manifests/" + start if start else ""):
                names += [o["Key"].rsplit("/", 1)[-1] for o in page.get("Contents", [])]
            return names
        return _s3_call("list s3://%s/%smanifests/%s*" % (bucket, prefix, begins), listing)

    def versions(self, after: Optional[int]) -> List[int]:
        """The versions listed, newer than `after`, in increasing order."""
        start = version_name(after) + ".~" if after is not None else ""
        names = self._manifest_names("v", start)
        found = {int(m.group(1)) for m in map(_MANIFEST.match, names) if m}
        return sorted(v for v in found if after is None or v > after)

    def _read_manifest(self, version: int) -> Any:
        vn = version_name(version)
        names = sorted(n for n in self._manifest_names(vn + ".") if _MANIFEST.match(n))
        if not names:
            raise NotFound("%s has no manifest of %s" % (self.describe(), vn))
        name = names[-1]  # any revision holds the same tensors; the newest sorts last
        if not self.uri.startswith("s3://"):
            path = os.path.join(self.uri, "manifests", name)
            try:
                with open(path, "rb") as f:
                    body = f.read()
            except OSError as e:
                raise (NotFound if isinstance(e, FileNotFoundError) else IOFailure)(
                    "cannot read %s: %s" % (path, e.strerror)) from None
        else:
            client, bucket, prefix = self._bucket()
            key = prefix + "manifests/" + name
            body = _s3_call("get s3://%s/%s" % (bucket, key), lambda: client.get_object(
                Bucket=bucket, Key=key)["Body"].read())
        try:
            return json.loads(body)
        except ValueError as e:
            raise Corrupt("%s: manifest %s is not JSON: %s" % (self.describe(), name, e)) from None

    def layout(self, version: int) -> Dict[str, TensorInfo]:
        if version not in self._layouts:
            self._layouts[version] = layout_of_manifest(
                self._read_manifest(version), "the manifest of %s in %s" % (
                    version_name(version), self.describe()))
        return self._layouts[version]

    def read_into(self, version: int, info: TensorInfo, out: Any) -> None:
        """Fills `out` (a CPU torch tensor of exactly info.nbytes) with the tensor."""
        self.reader.read_into(version, info.name, out)

    def close(self) -> None:
        self.reader.close()


def _read_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise IOFailure("%s: read at byte %d failed: %s (a block that fails its hash reads "
                            "as EIO)" % (what, offset + done, e.strerror)) from None
        if n == 0:
            raise Corrupt("%s: the file ends before byte %d" % (what, offset + len(view)))
        done += n


def _safetensors_header(path: str) -> Tuple[int, Any]:
    """(header bytes, parsed header) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise Corrupt("%s: not a safetensors file" % path)
            (size,) = struct.unpack("<Q", head)
            return size, json.loads(f.read(size))
    except OSError as e:
        raise IOFailure("cannot read the header of %s: %s" % (path, e.strerror)) from None
    except ValueError as e:
        raise Corrupt("%s: the safetensors header is not JSON: %s" % (path, e)) from None


def _safetensors_layout(path: str, file: str) -> Dict[str, TensorInfo]:
    size, header = _safetensors_header(path)
    out: Dict[str, TensorInfo] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = (int(x) for x in t["data_offsets"])
        shape = tuple(int(d) for d in t["shape"])
        if end - begin != _count(shape) * _element_bytes(name, t["dtype"]):
            raise Corrupt("%s: tensor %s has %d bytes for shape %s" % (path, name, end - begin,
                                                                       shape))
        out[name] = TensorInfo(name, t["dtype"], shape, end - begin, file, 8 + size + begin, None)
    return out


class MountSource:
    """A dtefs mount: the newest version is MOUNT/latest, versions are the
    vNNNNNNNN directories, tensors are read from their safetensors files
    (every block checked against its hash by the daemon: a bad one reads
    as EIO, never wrong bytes). Hashes come from the manifest of the store
    the mount serves (.dte/status "store") where this process can read it.
    Not thread-safe."""

    def __init__(self, mount: str) -> None:
        self.mount = mount
        if not os.path.exists(os.path.join(mount, ".dte", "status")):
            raise NotFound("%s is not a dtefs mount (no .dte/status)" % mount)
        self._layouts: Dict[int, Dict[str, TensorInfo]] = {}
        self._store: Optional[StoreSource] = None
        self._store_tried = False

    def describe(self) -> str:
        return "dtefs mount %s" % self.mount

    def status(self) -> Any:
        with open(os.path.join(self.mount, ".dte", "status"), "rb") as f:
            return json.loads(f.read())

    def latest(self) -> Optional[int]:
        try:
            target = os.readlink(os.path.join(self.mount, "latest"))
        except FileNotFoundError:
            return None  # an empty store
        m = _VERSION_DIR.match(os.path.basename(target.rstrip("/")))
        if not m:
            raise Corrupt("%s/latest points at %r, not a version" % (self.mount, target))
        return int(m.group(1))

    def versions(self, after: Optional[int]) -> List[int]:
        found = [int(m.group(1)) for m in map(_VERSION_DIR.match, os.listdir(self.mount)) if m]
        return sorted(v for v in found if after is None or v > after)

    def _hashes_from_store(self, version: int) -> Dict[str, Optional[str]]:
        """Tensor hashes of `version` from the mounted store's manifest, {}
        when this process cannot read it."""
        if not self._store_tried:
            self._store_tried = True
            try:
                self._store = StoreSource(str(self.status().get("store", "")))
            except (DteError, OSError, ValueError):  # no store here: hashes come from reads
                self._store = None
        if self._store is None:
            return {}
        try:
            return {n: t.hash for n, t in self._store.layout(version).items()}
        except DteError:  # gone, unreadable here: hashes come from reads
            return {}

    def layout(self, version: int) -> Dict[str, TensorInfo]:
        if version not in self._layouts:
            directory = os.path.join(self.mount, version_name(version))
            try:
                files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            except FileNotFoundError:
                raise NotFound("%s has no version %s" % (self.describe(),
                                                         version_name(version))) from None
            except OSError as e:
                raise IOFailure("cannot list %s: %s" % (directory, e.strerror)) from None
            out: Dict[str, TensorInfo] = {}
            for f in files:
                out.update(_safetensors_layout(os.path.join(directory, f), f))
            hashes = self._hashes_from_store(version)
            self._layouts[version] = {n: dataclasses.replace(t, hash=hashes.get(n))
                                      for n, t in out.items()}
        return self._layouts[version]

    def read_bytes(self, directory: str, info: TensorInfo, view: memoryview) -> None:
        """Reads info's bytes from MOUNT/<directory>/<file> into `view`."""
        path = os.path.join(self.mount, directory, info.file)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _read_exact(fd, view, info.offset, "%s (tensor %s)" % (path, info.name))
        finally:
            os.close(fd)

    def read_into(self, version: int, info: TensorInfo, out: Any) -> None:
        from dte._tensors import byte_view
        self.read_bytes(version_name(version), info, byte_view(out))

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
