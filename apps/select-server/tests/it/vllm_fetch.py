"""Fetches vllm/distributed/kv_events.py out of the pinned vLLM wheel without downloading it.

The wheel is 336 MB; the module is 20 KB. A wheel is a zip archive, so HTTP range requests
for its central directory and then for the one member are enough (a handful of requests).
The member is checked against a pinned SHA-256 before it is written.

argv: <wheel url> <member path> <expected sha256> <destination file>
"""

import hashlib
import io
import sys
import urllib.request
import zipfile


class RangeReader(io.RawIOBase):
    """A seekable read-only file over HTTP range requests."""

    def __init__(self, url):
        self.url = url
        self.pos = 0
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer):
        if self.pos >= self.size or len(buffer) == 0:
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(request, timeout=60) as r:
            # A server ignoring Range would send the whole wheel: refuse instead.
            if r.status != 206:
                raise RuntimeError(f"{self.url}: range request answered {r.status}, not 206")
            data = r.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def main():
    url, member, expected, destination = sys.argv[1:5]
    archive = zipfile.ZipFile(io.BufferedReader(RangeReader(url), buffer_size=1 << 16))
    data = archive.read(member)
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        sys.exit(f"{member} from {url}: sha256 {digest}, expected {expected}")
    with open(destination, "wb") as out:
        out.write(data)


if __name__ == "__main__":
    main()
