#!/usr/bin/env bash
# What the test suite needs beyond the Python environment, checked before any test
# runs: espeak-ng (real speech for the voice-activity tests), Chromium (the demo page
# in a headless browser) and a Redis on 127.0.0.1:6379 (the Redis session store is
# tested for real). As root with apt they are installed (and Redis started); otherwise
# the run stops here with one line saying what to install.
set -u

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }

missing=()
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if ! redis_up && ! command -v redis-server >/dev/null 2>&1; then
  missing+=(redis-server)
fi

if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "make test: installing ${missing[*]} (apt)" >&2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null 2>&1; then
      echo "make test: could not install ${missing[*]}; install them (apt-get install ${missing[*]}) and run again" >&2
      exit 1
    fi
  else
    echo "make test: the tests need ${missing[*]}: install them first (sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

if ! redis_up; then
  echo "make test: starting redis-server on 127.0.0.1:6379" >&2
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null 2>&1 || true
  for _ in $(seq 50); do redis_up && break; sleep 0.1; done
  if ! redis_up; then
    echo "make test: the tests need a Redis on 127.0.0.1:6379 and none could be started" >&2
    exit 1
  fi
fi
