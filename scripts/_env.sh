# Sourced by scripts/bench, scripts/test and scripts/lock: creates or reuses the project's
# virtual environments, each installed from its lock in locks/ (exact versions, what CI tested):
#   .venv         Python 3.12 + jax, the Pallas kernels and the dev tools (most tests, benchmarks)
#                 locks/jax-py312.txt
#   .venv-torch   Python 3.11 + torch==2.13.0 (CPU wheel) and no JAX (torch path, pure-numpy core)
#                 locks/torch-py311.txt
#   .venv-easydel Python 3.12 + easydel==0.3.0 (pins jax 0.9.2) + hicache_jax without its jax extra
#                 (the EasyDeL integration tests, tests/integrations)   locks/easydel-py312.txt
#   .venv-upstream (scripts/upstream_baseline_env.sh) has its own hand-made closure,
#                 benchmarks/upstream_requirements.txt, installed with --no-deps.
# The wheel test (tests/jax_backend/test_wheel_example.py) installs the README's extras under
# locks/wheel-py311.txt and locks/wheel-py312.txt.
#
# Locks are made by `uv pip compile` (ENV_SPECS below: the Python version, the extras, extra
# requirements) and refreshed by ./scripts/lock, which prints what changed. An environment is
# (re)built by `uv pip sync` of its lock (exactly those packages, nothing else), then the
# project itself, editable, with the lock as constraints: a dependency added to pyproject.toml
# but not locked still installs, and tests/core/test_env_lock.py then fails, naming it.
# A venv is rebuilt when its lock, pyproject.toml or its install arguments change (a hash is
# stamped inside it). uv (UV_VERSION) is installed into .venv-uv by pip on first use.
# torch's CPU wheel is not on PyPI: it comes from the directory in PIP_FIND_LINKS (the project's
# machines have it in /opt/wheels), handed to uv as --find-links.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
UV_VERSION=0.13.9
LOCKS="$ROOT/locks"

# lock name -> "python-version|extras of the project"; locks/<name>.in adds requirements beyond
# the project's (pip, so every venv has one; torch's CPU build for the torch env).
declare -A ENV_SPECS=(
  [jax-py312]="3.12|jax,engine,storage,metrics,bench,dev,mooncake,models"
  [torch-py311]="3.11|dev"
  [easydel-py312]="3.12|easydel,storage,metrics,dev"
  [wheel-py311]="3.11|jax,storage,metrics"
  [wheel-py312]="3.12|jax,storage,metrics"
)
LOCK_NAMES=(jax-py312 torch-py311 easydel-py312 wheel-py311 wheel-py312)

_find_python() {  # $1 = major.minor; prints an interpreter path or nothing
  local v="$1" c
  for c in "python$v" "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/$v"*/bin/python3; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in $(pyenv versions --bare 2>/dev/null | grep "^$v" | sort -rV); do
      echo "$(pyenv root)/versions/$c/bin/python3"; return 0
    done
  fi
  if command -v python3 >/dev/null 2>&1 && python3 -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))"; then
    command -v python3; return 0
  fi
}

# Prints the path of a uv of UV_VERSION, installing it into .venv-uv first if needed.
ensure_uv() {
  local uv="$ROOT/.venv-uv/bin/uv"
  if [ -x "$uv" ] && [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" = "$UV_VERSION" ]; then
    echo "$uv"; return 0
  fi
  local py; py="$(_find_python 3.12)"; [ -n "$py" ] || py="$(command -v python3)"
  echo ">> installing uv $UV_VERSION into .venv-uv ..." >&2
  rm -rf "$ROOT/.venv-uv"
  "$py" -m venv "$ROOT/.venv-uv" >&2
  "$ROOT/.venv-uv/bin/python" -m pip install -q "uv==$UV_VERSION" >&2
  echo "$uv"
}

# uv arguments every install and compile shares: torch's CPU wheel directory, if any.
_uv_find_links() {
  local d
  for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
    [ -d "$d" ] && { echo "--find-links $d"; return 0; }
  done
  return 0
}

_spec_field() { local IFS='|'; read -r -a f <<< "${ENV_SPECS[$1]}"; echo "${f[$2]:-}"; }

# The lock's inputs for `uv pip compile` (relative to the root): pyproject.toml with the env's
# extras, and locks/<name>.in. $1 = lock name.
lock_inputs() {
  local name="$1" e
  echo "pyproject.toml locks/$name.in"
  for e in $(_spec_field "$name" 1 | tr ',' ' '); do echo "--extra $e"; done
}

_stamp() { { cat "$ROOT/pyproject.toml" "$LOCKS/$1.txt" "$LOCKS/$1.in"; echo "$*" "$UV_VERSION"; } | sha256sum | cut -c1-16; }

_ensure_venv() {  # $1 = venv dir, $2 = lock name
  local dir="$ROOT/$1" name="$2"
  local lock="$LOCKS/$name.txt" ver extras want uv py
  ver="$(_spec_field "$name" 0)"; extras="$(_spec_field "$name" 1)"
  want="$(_stamp "$name" "$1")"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.hicache-stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  [ -f "$lock" ] || { echo "error: $lock missing (./scripts/lock makes it)" >&2; return 1; }
  py="$(_find_python "$ver")"
  if [ -z "$py" ]; then
    echo "error: Python $ver not found (tried python$ver, pyenv versions $ver.*)" >&2; return 1
  fi
  uv="$(ensure_uv)"
  echo ">> creating ${dir#$ROOT/} with $py ($("$py" --version)) from locks/$name.txt ..." >&2
  rm -rf "$dir"
  # shellcheck disable=SC2046
  (cd "$ROOT" && "$uv" venv -q -p "$py" "$dir" \
     && "$uv" pip sync -q -p "$dir/bin/python" $(_uv_find_links) "$lock" \
     && "$uv" pip install -q -p "$dir/bin/python" $(_uv_find_links) -c "$lock" -e ".[$extras]")
  echo "$want" > "$dir/.hicache-stamp"
}

# The Debian libraries the mooncake wheel links against (libibverbs, librdmacm, libnuma).
# Installed when missing and we are root; otherwise (or if apt fails) the Mooncake tests
# skip and say why. Never fails the caller.
ensure_mooncake_libs() {
  local missing=() lib
  command -v ldconfig >/dev/null 2>&1 || return 0
  for lib in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    ldconfig -p 2>/dev/null | grep -q "${lib%%:*} " || missing+=("${lib##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo ">> note: ${missing[*]} missing and not root (or no apt-get): the Mooncake tests will skip" >&2
    return 0
  fi
  echo ">> installing ${missing[*]} (for the mooncake L3 backend) ..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >/dev/null 2>&1 || echo ">> note: apt-get install ${missing[*]} failed: the Mooncake tests will skip" >&2
  return 0
}

ensure_jax_env() { ensure_mooncake_libs; _ensure_venv .venv jax-py312; }
ensure_torch_env() { _ensure_venv .venv-torch torch-py311; }

# EasyDeL 0.3.0 pins jax/jaxlib 0.9.2 (its API moves fast: keep the pin); hicache_jax goes in
# without the [jax] extra so that jax stays. Pillow is an undeclared dependency of easydel.
# Returns non-zero (and says why) when it cannot be built; the caller skips the run then.
ensure_easydel_env() {
  # A child shell: here (the left side of a ||) set -e would not stop a failed install.
  bash -c "source '$ROOT/scripts/_env.sh' && _ensure_venv .venv-easydel easydel-py312" || return 1
}
