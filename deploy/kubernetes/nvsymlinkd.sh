#!/bin/sh
# the console script pip would make, for an image built without pip
exec python3 -m nvsymlinkd "$@"
