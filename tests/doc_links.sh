#!/bin/sh
# Every Markdown file that the README, docs/ and the sources' comments name
# exists in the tree: a reader is never sent to a note outside the
# repository. A name with a folder is looked up from the root or beside the
# file that names it; a bare name also in docs/.
#   tests/doc_links.sh SOURCE_DIR
set -u
root=$1
cd "$root" || exit 1
fail=0
files=$(find README.md docs python/README.md daemon cuda client common tools \
            -type f \( -name '*.md' -o -name '*.c' -o -name '*.h' -o -name '*.cu' \
                       -o -name '*.cuh' \) 2>/dev/null)
for f in $files; do
    dir=$(dirname "$f")
    # a name starts the line or follows a blank, a backtick or a parenthesis
    for ref in $(grep -oE '(^|[ `(])(\.\./)*[A-Za-z0-9_/.-]*[A-Za-z0-9_]\.md' "$f" |
                 sed 's/^[ `(]//' | sort -u); do
        case $ref in
        ../*) echo "FAIL: $f names $ref, outside the tree"; fail=1; continue ;;
        esac
        if [ -f "$ref" ] || [ -f "$dir/$ref" ]; then continue; fi
        case $ref in
        */*) ;;
        *) [ -f "docs/$ref" ] && continue ;;
        esac
        echo "FAIL: $f names $ref, which is not in the tree"; fail=1
    done
done
[ $fail -eq 0 ] && echo "PASS: every Markdown file named exists"
exit $fail
