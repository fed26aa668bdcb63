#!/bin/sh
# The man pages: they render without warnings (groff -ww), dpclipd.conf(5)
# documents every key dpclipd --check-config prints (and so does the
# settings table of docs/operations.md), and dpclipd(8) every flag
# dpclipd --help lists and every DPCLIP_* variable daemon/ and cuda/ read.
#   tests/man_check.sh DPCLIPD MANDIR
set -u
dpclipd=$1
mandir=$2
fail=0
if command -v groff >/dev/null 2>&1; then
    for page in "$mandir"/*.[0-9]; do
        out=$(groff -man -Tutf8 -ww -z "$page" 2>&1)
        if [ -n "$out" ]; then
            echo "FAIL: $page: groff warnings:"; echo "$out"; fail=1
        fi
    done
else
    echo "SKIP: groff not installed: man pages not rendered (install groff-base)"
fi
section=
keys=0
for line in $("$dpclipd" --check-config --config /dev/null | sed -n 's/^\[\(.*\)\]$/[\1]/p; s/^\([a-z_]*\) = .*/\1/p'); do
    case $line in
    \[*\]) section=$(echo "$line" | tr -d '[]') ;;
    *)
        keys=$((keys + 1))
        if ! grep -q "($section.$line)" "$mandir/dpclipd.conf.5"; then
            echo "FAIL: dpclipd.conf.5 does not document $section.$line"; fail=1
        fi
        if ! grep -q "^|.*\`$section.$line\`" "$mandir/../docs/operations.md"; then
            echo "FAIL: docs/operations.md's settings table lacks $section.$line"; fail=1
        fi ;;
    esac
done
[ "$keys" -gt 20 ] || { echo "FAIL: only $keys keys read from --check-config"; fail=1; }
# a key's entry says "reloadable" exactly when --check-config does not say
# "(restart to change)" in the comment above it
for kr in $("$dpclipd" --check-config --config /dev/null | awk '
        /^\[/ { sec = substr($0, 2, length($0) - 2) }
        /^# / { c = $0 }
        /^[a-z_]+ = / { split($0, a, " "); print sec "." a[1] ":" (c ~ /restart to change/ ? "no" : "yes") }'); do
    key=${kr%:*}
    entry=$(awk -v k="($key)" 'index($0, k) { p = 1 } p && /^\.(TP|SH)/ { exit } p { print }' \
            "$mandir/dpclipd.conf.5")
    if echo "$entry" | grep -q reloadable; then said=yes; else said=no; fi
    if [ "$said" != "${kr#*:}" ]; then
        echo "FAIL: dpclipd.conf.5 on $key: reloadable '$said', dpclipd says '${kr#*:}'"; fail=1
    fi
done
flags=0
for flag in $("$dpclipd" --help 2>&1 | grep -o -- '--[a-z][a-z-]*' | sort -u); do
    flags=$((flags + 1))
    esc=$(echo "$flag" | sed 's/-/\\\\-/g')
    if ! grep -q -- "$esc" "$mandir/dpclipd.8"; then
        echo "FAIL: dpclipd.8 does not document $flag"; fail=1
    fi
done
[ "$flags" -gt 20 ] || { echo "FAIL: only $flags flags read from --help"; fail=1; }
# every DPCLIP_* variable the daemon's code reads (daemon/, cuda/)
envs=0
for var in $(cat "$mandir"/../daemon/*/*.c "$mandir"/../cuda/*/*.cu "$mandir"/../cuda/*/*.h |
             grep -o 'getenv("DPCLIP_[A-Z0-9_]*")\|"DPCLIP_CUDA_[A-Z0-9_]*"' |
             grep -o 'DPCLIP_[A-Z0-9_]*' | sort -u); do
    envs=$((envs + 1))
    if ! grep -q "^\.B $var\$" "$mandir/dpclipd.8"; then
        echo "FAIL: dpclipd.8 does not document the environment variable $var"; fail=1
    fi
done
[ "$envs" -gt 5 ] || { echo "FAIL: only $envs environment variables found in the sources"; fail=1; }
[ $fail -eq 0 ] && echo "man pages: $keys keys, $flags flags and $envs environment variables documented"
exit $fail
