"""journald's native datagram protocol, decoded; shared by the tests that stand in for journald.

PARSE_SOURCE is the same function as source text, for the scripts those tests run in a private
mount namespace (they cannot import from tests/).
"""

PARSE_SOURCE = r'''
import struct

def parse(data):
    """One datagram -> {FIELD: value}: `KEY=value\n`, or `KEY\n<le64 size><value>\n` for values with newlines."""
    fields, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            size = struct.unpack_from("<Q", data, nl + 1)[0]
            value = data[nl + 9:nl + 9 + size]
            i = nl + 9 + size + 1
        fields[key.decode()] = value.decode(errors="replace")
    return fields
'''

namespace: dict = {}
exec(PARSE_SOURCE, namespace)
parse = namespace["parse"]
