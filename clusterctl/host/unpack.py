"""Installing the host package on a host: the one piece of code every way of getting it there runs.

It runs before the package is on the host, so it travels as source text inside a `python3 -S -E -c` script:
over ssh (clusterctl/ops/hosttools.py, the package on stdin) and as the first thing a Slurm batch script or
task runs (clusterctl/host/slurm.py BOOT, the package in its here-document). Both scripts are built from
IMPORTS and INSTALL below, so that the checks and the atomic rename cannot drift apart between the backends.
"""

IMPORTS = "import hashlib, json, os, shutil, sys, tempfile, zlib\n"

# install(head, blob, dest, who): unpack the zlib `blob` of head["files"] ([path, size] back to back, checked
# against head["sha256"]) into `dest` unless it is there: a private temporary directory next to it, renamed
# into place (two sessions installing at once: the second one's rename fails and it uses the first one's);
# exits with `who: ...` on a short or corrupt upload. The parent directory is created 0700.
INSTALL = r'''
def install(head, blob, dest, who):
    if len(blob) != head["size"]:
        sys.exit("%s: short read of the host package %s" % (who, head["dir"]))
    if os.path.isdir(dest):
        return
    data = zlib.decompress(blob)
    if hashlib.sha256(data).hexdigest() != head["sha256"]:
        sys.exit("%s: corrupt upload of the host package %s" % (who, head["dir"]))
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-host-", dir=parent)
    pos = 0
    for rel, size in head["files"]:
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data[pos:pos + size])
        pos += size
    try:
        os.rename(tmp, dest)
    except OSError:  # another session installed it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(dest):
            raise
'''
