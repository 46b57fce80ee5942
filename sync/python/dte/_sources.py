"""Where a Follower reads versions from: a store URI (a local directory or
s3://) or a dtefs mount. Both answer the same questions: the newest
version, the versions there are, a version's tensor table (name, dtype,
shape, file, offset, and the XXH3-128 hash where the manifest is readable
here), and a verified read of one tensor's bytes.

One reader of the format: everything about the store comes from libdte
(dte.StoreReader, sync/capi/c_api.h), the C++ code dtectl and dtefs read it
with. A store's versions come from its checked listings, whose newest
version's manifest was read, and `latest` never goes back while that
version's manifest exists; a version's tensor table comes from its
manifest. Nothing here parses a manifest, a manifest key or a listing, or
talks to S3.

A mount is a filesystem: its namespace (MOUNT/latest, the vNNNNNNNN
directories, the .safetensors files in them, .dte/status) is read with the
os module, the files' headers by libdte's safetensors parser (the one an
import validates checkpoints with), and the bytes by reads of the files,
which the daemon checks block by block. The hashes come from the
manifests of the store the mount serves (.dte/status "store"), through
libdte, where this process can read that store."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, List, Optional

from dte._errors import Corrupt, DteError, IOFailure, NotFound
from dte._reader import StoreReader, TensorInfo, file_tensors

# A version directory of a mount (the mount's namespace, docs/fs.md).
_VERSION_DIR = re.compile(r"^v(\d{8,})$")


def version_name(version: int) -> str:
    return "v%08d" % version


class StoreSource:
    """A store URI, read through one dte.StoreReader: the checked listings,
    latest, manifests' tensor tables and verified reads of libdte. Not
    thread-safe."""

    def __init__(self, uri: str, cache_dir: Optional[str] = None) -> None:
        self.uri = uri
        self.reader = StoreReader(uri, cache_dir)
        self._layouts: Dict[int, Dict[str, TensorInfo]] = {}

    def describe(self) -> str:
        return "store %s" % self.uri

    def latest(self) -> Optional[int]:
        return self.reader.latest()

    def versions(self, after: Optional[int]) -> List[int]:
        """The committed versions newer than `after`, in increasing order."""
        return self.reader.versions(after)

    def layout(self, version: int) -> Dict[str, TensorInfo]:
        if version not in self._layouts:
            self._layouts[version] = self.reader.tensors(version)
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


class MountSource:
    """A dtefs mount: the newest version is MOUNT/latest, versions are the
    vNNNNNNNN directories, tensor tables come from their safetensors files'
    headers (parsed by libdte), tensors are read from those files (every
    block checked against its hash by the daemon: a bad one reads as EIO,
    never wrong bytes). Hashes come from the manifest of the store the
    mount serves (.dte/status "store"), read through libdte where this
    process can read that store. Not thread-safe."""

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
                out.update(file_tensors(os.path.join(directory, f)))
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
