# Sourced by the device scripts: every JSON (benchmarks/_common.py) and junit file (tests/conftest.py)
# they write records the commit that ran and whether the tree was dirty. The device copy has no
# reliable .git (a stale one once put a wrong commit into a result), so both come from the caller:
#   NEUTRAIN_GIT_COMMIT=$(git rev-parse HEAD) NEUTRAIN_GIT_DIRTY=$(test -z "$(git status --porcelain)"; echo $?) ...
: "${NEUTRAIN_GIT_COMMIT:?set NEUTRAIN_GIT_COMMIT=\$(git rev-parse HEAD) for the tree being measured}"
: "${NEUTRAIN_GIT_DIRTY:?set NEUTRAIN_GIT_DIRTY=1 if that tree had uncommitted changes, else 0}"
case "$NEUTRAIN_GIT_COMMIT" in
  *[!0-9a-f]* | "" ) echo "NEUTRAIN_GIT_COMMIT='$NEUTRAIN_GIT_COMMIT' is not a commit hash" >&2; exit 2 ;;
esac
export NEUTRAIN_GIT_COMMIT NEUTRAIN_GIT_DIRTY
