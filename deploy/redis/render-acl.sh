#!/bin/sh
# Render users.acl.template into a Redis ACL file holding SHA-256 password hashes only.
# POSIX-shell twin of render_acl.py (same placeholders, same checks), for the redis image's init step.
# Usage: render-acl.sh TEMPLATE OUTPUT   (passwords and SLICESCHED_PREFIX come from the environment)
set -eu

fail() {
    echo "render-acl: $*" >&2
    exit 2
}

[ $# -eq 2 ] || fail "usage: render-acl.sh TEMPLATE OUTPUT"
template=$1
output=$2
prefix=${SLICESCHED_PREFIX:-slicesched:}
stem=${prefix%:}
case $prefix in
    *:) ;;
    *) fail "SLICESCHED_PREFIX: '$prefix' must be letters, digits, '._-{}' and end with ':'" ;;
esac
case $stem in
    '' | *[!A-Za-z0-9._{}-]*) fail "SLICESCHED_PREFIX: '$prefix' must be letters, digits, '._-{}' and end with ':'" ;;
esac

umask 077
tmp="$output.tmp.$$"
trap 'rm -f "$tmp"' EXIT
grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$template" > "$tmp"

for name in $(grep -o '\${[A-Z][A-Z0-9_]*:sha256}' "$tmp" | sed 's/^\${\(.*\):sha256}$/\1/' | sort -u); do
    eval "value=\${$name:-}"
    [ -n "$value" ] || fail "$name: not set (see docs/deployment.md, 'Secrets to set')"
    case $value in
        REPLACE_ME*) fail "$name: still the placeholder '$value'; set a real password" ;;
        *[!A-Za-z0-9._~-]*) fail "$name: only letters, digits and '-._~' are allowed (the password goes into a URL)" ;;
    esac
    [ ${#value} -ge 12 ] || fail "$name: shorter than 12 characters"
    hash=$(printf '%s' "$value" | sha256sum | cut -d' ' -f1)
    sed -i "s/\${$name:sha256}/$hash/g" "$tmp"
done
sed -i "s/\${PREFIX}/$prefix/g" "$tmp"
if grep -q '\${' "$tmp"; then
    fail "template: unknown placeholder: $(grep '\${' "$tmp" | head -n 1)"
fi

mv "$tmp" "$output"
trap - EXIT
# Running as root (compose init step): hand the file to the redis user the server drops to.
if [ "$(id -u)" = 0 ] && id redis > /dev/null 2>&1; then
    chown redis:redis "$output"
fi
echo "render-acl: wrote $output ($(grep -c '^user ' "$output") users)"
