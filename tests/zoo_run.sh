#!/bin/sh
# ctest's python_zoo: the model zoo (python/tests/test_zoo.py) with the
# Python of .venv-zoo, the virtual environment scripts/deps.sh makes with
# transformers 4.45.x where PyPI is reachable. Without it: skipped (77).
#   tests/zoo_run.sh SOURCE_DIR
root=$1
py=$root/.venv-zoo/bin/python
if [ ! -x "$py" ]; then
    echo "SKIP: no .venv-zoo (scripts/deps.sh makes it where PyPI is reachable)"
    exit 77
fi
if ! "$py" -c "import transformers" 2>/dev/null; then
    echo "SKIP: .venv-zoo has no transformers (scripts/deps.sh installs it where PyPI is reachable)"
    exit 77
fi
cd "$root" || exit 1
exec "$py" -m pytest -q -p no:cacheprovider -rs python/tests/test_zoo.py
