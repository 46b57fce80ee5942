"""The one-way rule of docs/architecture.md ("Modules"), kept by reading the
source: every #include "..." in kernels/, store/, sync/, fs/ and tools/
points down the module graph (never up or sideways, never into another
module's internal/), third-party headers are included only by the module
that wraps them, and each CMake target links only the modules below it and
the third-party libraries it owns. The graph is written here once and
checked against the diagram in docs/architecture.md, so the two cannot
drift apart.

Reads files only; needs no build."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE_DIRS = ("kernels", "store", "sync", "fs", "tools")
SOURCE_EXTS = (".h", ".cc", ".cu", ".cuh")

# Each module (a folder) and the modules it uses directly: the arrows of
# docs/architecture.md. A module may use what these reach, transitively.
DEPS = {
    "kernels": set(),
    "store/base": {"kernels"},
    "store": {"store/base"},
    "store/write": {"store"},
    "store/ops": {"store/write"},
    "sync/transport": {"store"},
    "sync/convert": {"store"},
    "sync/transfer": {"sync/transport", "sync/convert"},
    "sync/push": {"sync/transfer"},
    "sync/live": {"sync/transfer"},
    "sync/metrics": {"store/base"},
    "sync/publish": {"sync/push", "store/ops", "sync/metrics"},
    "sync/capi": {"sync/publish", "sync/live"},
    "fs": {"store", "sync/live", "sync/metrics"},
    "tools": {"fs", "sync/capi"},
}

# Third-party headers (a path prefix of #include <...>) and the one module
# that wraps each library.
HEADER_OWNERS = {
    "prometheus/": "sync/metrics",
    "rocksdb/": "store",
    "curl/": "store",
    "openssl/": "store",
    "zstd.h": "store",
    "xxhash.h": "store",
    "nccl.h": "sync/transport",
    "fuse": "fs",
    "CLI/": "tools",
}
# Libraries whose types stay behind their wrapper: no public header (outside
# internal/) includes them.
PRIVATE_HEADERS = ("prometheus/", "rocksdb/", "curl/", "nccl.h", "fuse")
# The benchmarks measure internals, as tests do: they may include any
# module's internal/ headers.
INTERNAL_READERS = ("tools/bench/",)
# Other modules' internal/ headers that a module includes (none: a header
# two modules share is a public header of the module that owns it).
INTERNAL_EXCEPTIONS: set = set()
# (file, header) pairs allowed outside the owner, each with its reason.
HEADER_EXCEPTIONS = {
    # The codec benchmark measures zstd itself as the baseline.
    ("tools/bench/codec_bench.cc", "zstd.h"),
}

# CMake targets and the module each belongs to. Programs defined under
# tools/ belong to tools.
TARGETS = {
    "dte_kernels": "kernels",
    "dte_base": "store/base",
    "dte_store": "store",
    "dte_write": "store/write",
    "dte_ops": "store/ops",
    "dte_transport": "sync/transport",
    "dte_convert": "sync/convert",
    "dte_transfer": "sync/transfer",
    "dte_push": "sync/push",
    "dte_live": "sync/live",
    "dte_metrics": "sync/metrics",
    "dte_publish": "sync/publish",
    "dte_capi": "sync/capi",
    "dte_capi_objects": "sync/capi",
    "dte_shared": "sync/capi",
    "dte_sync": "sync/capi",
    "dte_fs": "fs",
}
# Third-party link items and the module that may link each (None: any).
# nlohmann-json is the JSON vocabulary: linked by every module that includes
# it and by no other (checked apart). libdte.so's link options also name the
# shared RocksDB (sync/CMakeLists.txt says why); options are not read here.
LINK_OWNERS = {
    "Threads::Threads": None,
    "CUDA::cudart_static": "kernels",
    "PkgConfig::ZSTD": "store",
    "PkgConfig::XXHASH": "store",
    "RocksDB::rocksdb": "store",
    "CURL::libcurl": "store",
    "OpenSSL::Crypto": "store",
    "${NCCL_LIBRARY}": "sync/transport",
    "prometheus-cpp::core": "sync/metrics",
    "prometheus-cpp::pull": "sync/metrics",
    "prometheus-cpp::push": "sync/metrics",
    "PkgConfig::FUSE3": "fs",
    "CLI11::CLI11": "tools",
}
JSON_LIB = "nlohmann_json::nlohmann_json"
KEYWORDS = {"PUBLIC", "PRIVATE", "INTERFACE"}


def module_of(path):
    """The module holding `path` (relative to the root): the longest module
    folder that contains it, or None."""
    best = None
    for m in DEPS:
        if (path == m or path.startswith(m + "/")) and (best is None or len(m) > len(best)):
            best = m
    return best


def reach(graph):
    """Each module and every module it may use (itself included)."""
    out = {}
    for m in graph:
        seen, todo = {m}, [m]
        while todo:
            for d in graph[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        out[m] = seen
    return out


def source_files(root):
    for top in SOURCE_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for n in sorted(names):
                if n.endswith(SOURCE_EXTS):
                    yield os.path.relpath(os.path.join(dirpath, n), root)


INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.M)


def includes(text):
    """(line, kind, path) of each #include; kind is '"' or '<'."""
    for m in INCLUDE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)


def project_include_errors(path, line, target, allowed):
    src = module_of(path)
    if target.split("/")[0] not in SOURCE_DIRS + ("tests",):
        return []  # a system or third-party header written with quotes
    dst = module_of(target)
    where = '%s:%d: #include "%s"' % (path, line, target)
    if dst is None:
        return ["%s: not a module's header (a module includes no tests/ code)" % where]
    if dst not in allowed[src]:
        return ["%s points up or sideways: %s may use only %s, not %s"
                % (where, src, ", ".join(sorted(allowed[src] - {src})) or "nothing", dst)]
    if (dst != src and "/internal/" in target[len(dst):]
            and (src, target) not in INTERNAL_EXCEPTIONS and not path.startswith(INTERNAL_READERS)):
        return ["%s: %s/internal/ is private to %s" % (where, dst, dst)]
    return []


def third_party_include_errors(path, line, header):
    src = module_of(path)
    where = "%s:%d: #include <%s>" % (path, line, header)
    errors = []
    for prefix, owner in HEADER_OWNERS.items():
        if not header.startswith(prefix) or (path, header) in HEADER_EXCEPTIONS:
            continue
        if src != owner:
            errors.append("%s: only %s wraps this library" % (where, owner))
        elif (prefix in PRIVATE_HEADERS and path.endswith(".h")
              and "/internal/" not in path[len(src):]):
            errors.append("%s: a public header of %s exposes the library "
                          "(move it to %s/internal/)" % (where, src, src))
    return errors


def include_errors(root, graph):
    allowed = reach(graph)
    errors = []
    for path in source_files(root):
        if module_of(path) is None:
            errors.append("%s: in no module of the graph" % path)
            continue
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for line, kind, target in includes(text):
            if kind == '"':
                errors += project_include_errors(path, line, target, allowed)
            else:
                errors += third_party_include_errors(path, line, target)
    return errors


# --- CMake -----------------------------------------------------------------

CALL = re.compile(r"\b(target_link_libraries|dte_tool)\s*\(([^()]*)\)")


def cmake_links(root):
    """(CMakeLists path, target, unit, [items]) of each target_link_libraries
    and dte_tool call under the source folders; `unit` is the module, or
    tools/DIR for a program."""
    out = []
    for top in SOURCE_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            if "CMakeLists.txt" not in names:
                continue
            path = os.path.join(dirpath, "CMakeLists.txt")
            rel = os.path.relpath(path, root)
            with open(path, encoding="utf-8") as f:
                text = re.sub(r"#[^\n]*", "", f.read())
            # A function's body links its parameters, not targets.
            text = re.sub(r"\bfunction\s*\(.*?\bendfunction\s*\(\s*\)", "", text, flags=re.S)
            for call, args in CALL.findall(text):
                words = args.split()
                if call == "dte_tool":
                    name, folder, items = words[0], words[1], words[2:]
                    out.append((rel, name, "tools/" + folder, items))
                else:
                    name, items = words[0], words[1:]
                    unit = TARGETS.get(name)
                    if unit is None and rel.startswith("tools/"):
                        unit = os.path.dirname(rel)
                    out.append((rel, name, unit, items))
    return out


def json_includers(root):
    """The modules and tools/DIR folders whose sources include nlohmann-json."""
    units = set()
    for path in source_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            if "<nlohmann/json.hpp>" in f.read():
                parts = path.split("/")
                units.add("/".join(parts[:2]) if parts[0] == "tools" else module_of(path))
    return units


def link_errors(root, graph):
    allowed = reach(graph)
    users = json_includers(root)
    errors = []
    for rel, name, unit, items in cmake_links(root):
        if unit is None:
            errors.append("%s: target %s is in no module (name it in TARGETS)" % (rel, name))
            continue
        mod = module_of(unit)
        for item in items:
            if item in KEYWORDS:
                continue
            where = "%s: %s links %s" % (rel, name, item)
            if item in TARGETS:
                if TARGETS[item] not in allowed[mod]:
                    errors.append("%s, which points up or sideways (%s -> %s)"
                                  % (where, mod, TARGETS[item]))
            elif item == JSON_LIB:
                if unit not in users:
                    errors.append("%s, but no source of %s includes it" % (where, unit))
            elif item not in LINK_OWNERS:
                errors.append("%s: a library the graph does not know (name its owner)" % where)
            elif LINK_OWNERS[item] not in (None, mod):
                errors.append("%s: only %s wraps it" % (where, LINK_OWNERS[item]))
    linked = {unit for _, _, unit, items in cmake_links(root) if JSON_LIB in items}
    for unit in sorted(users - linked):
        errors.append("%s includes nlohmann-json without linking it" % unit)
    return errors


# --- the diagram of docs/architecture.md -----------------------------------

def doc_graph(root):
    """The arrows of the first diagram after "## Modules" that draws them:
    `a <- b <- c` (c uses b, b uses a), `x, y <- z`, chains split by ';'."""
    with open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Modules"):]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    block = next(b for b in blocks if " <- " in b)
    graph = {}
    for chain in re.split(r"[;\n]", block):
        groups = [[m.strip() for m in g.split(",") if m.strip()] for g in chain.split("<-")]
        for lower, upper in zip(groups, groups[1:]):
            for u in upper:
                graph.setdefault(u, set()).update(lower)
            for low in lower:
                graph.setdefault(low, set())
    return graph


def test_the_graph_here_is_the_one_the_docs_draw():
    assert doc_graph(ROOT) == DEPS


def test_the_graph_has_no_cycle():
    allowed = reach(DEPS)
    cycles = [(a, b) for a in DEPS for b in DEPS[a] if a in allowed[b]]
    assert cycles == []


def test_every_include_points_down_the_graph():
    errors = include_errors(ROOT, DEPS)
    assert errors == [], "\n" + "\n".join(errors)


def test_every_target_links_only_what_it_may():
    errors = link_errors(ROOT, DEPS)
    assert errors == [], "\n" + "\n".join(errors)


def test_a_planted_upward_include_is_named(tmp_path):
    """The checks find what they are for, in a small tree of their own."""
    def write(path, text):
        p = tmp_path / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    write("store/base/status.h", "#pragma once\n")
    write("store/store.cc", '#include "store/base/status.h"\n#include <xxhash.h>\n')
    write("sync/metrics/listen.cc",
          '#include "store/base/status.h"\n\n#include "store/store.h"\n')
    write("sync/push/push_server.cc", '#include "sync/transfer/internal/p2p_pairs.h"\n')
    write("sync/metrics/registry.h", "#include <prometheus/registry.h>\n")
    write("fs/metrics.cc", '#include "sync/publish/publisher.h"\n#include <prometheus/gateway.h>\n')
    write("kernels/scatter.cc", '#include "tests/testutil/checkpoint.h"\n')
    write("sync/CMakeLists.txt",
          "target_link_libraries(dte_metrics PUBLIC dte_store)  # a comment\n"
          "target_link_libraries(dte_publish PRIVATE prometheus-cpp::core\n"
          "  nlohmann_json::nlohmann_json)\n")
    errors = include_errors(str(tmp_path), DEPS) + link_errors(str(tmp_path), DEPS)
    text = "\n".join(errors)
    assert 'sync/metrics/listen.cc:3: #include "store/store.h" points up or sideways' in text
    assert "sync/metrics may use only kernels, store/base, not store" in text
    assert ('sync/push/push_server.cc:1: #include "sync/transfer/internal/p2p_pairs.h": '
            "sync/transfer/internal/ is private") in text
    assert 'fs/metrics.cc:1: #include "sync/publish/publisher.h" points up or sideways' in text
    assert "fs/metrics.cc:2: #include <prometheus/gateway.h>: only sync/metrics" in text
    assert "sync/metrics/registry.h:1: #include <prometheus/registry.h>: a public header" in text
    assert 'kernels/scatter.cc:1: #include "tests/testutil/checkpoint.h": not a module' in text
    assert ("sync/CMakeLists.txt: dte_metrics links dte_store, which points up or sideways "
            "(sync/metrics -> store)") in text
    assert ("sync/CMakeLists.txt: dte_publish links prometheus-cpp::core: only sync/metrics "
            "wraps it") in text
    assert ("sync/CMakeLists.txt: dte_publish links nlohmann_json::nlohmann_json, but no "
            "source of sync/publish includes it") in text
    assert "store/store.cc" not in text
    assert len(errors) == 9, text
