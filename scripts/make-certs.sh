#!/usr/bin/env bash
# Make a private CA for one Stalwart cluster and a certificate for each daemon or operator.
#
#   scripts/make-certs.sh DIR NAME[=SAN,SAN...] [NAME[=SAN,...] ...]
#
# DIR/ca.pem and DIR/ca.key are created once and reused on later runs, so nodes can be
# added without re-issuing the others. Each NAME gets DIR/NAME.pem and DIR/NAME.key
# (EC P-256, valid for DAYS days, default 825). The certificate names NAME itself plus
# every SAN given (host names or IP addresses the peers dial), e.g.
#   scripts/make-certs.sh /etc/stalwart/tls node1=10.0.0.1 node2=10.0.0.2 operator
# Keep ca.key off the nodes: each node needs ca.pem, its NAME.pem and its NAME.key.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
dir=$1
shift
days=${DAYS:-825}
mkdir -p "$dir"
umask 077

if [ ! -f "$dir/ca.key" ]; then
    openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key"
    openssl req -x509 -new -key "$dir/ca.key" -sha256 -days "$days" \
        -subj "/CN=stalwart cluster CA $(date -u +%Y%m%dT%H%M%SZ)" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$dir/ca.pem"
fi

for spec in "$@"; do
    name=${spec%%=*}
    case "$name" in
        ''|*/*|.*) echo "make-certs: bad name '$name' (letters, digits, '.', '-')" >&2; exit 2 ;;
    esac
    sans="DNS:$name"
    if [ "$spec" != "$name" ]; then
        IFS=',' read -ra extra <<< "${spec#*=}"
        for san in "${extra[@]}"; do
            if [[ "$san" =~ ^[0-9.]+$ || "$san" == *:* ]]; then
                sans="$sans,IP:$san"
            else
                sans="$sans,DNS:$san"
            fi
        done
    fi
    openssl ecparam -name prime256v1 -genkey -noout -out "$dir/$name.key"
    openssl req -new -key "$dir/$name.key" -subj "/CN=$name" -out "$dir/$name.csr"
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' \
        "$sans" > "$dir/$name.ext"
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -CAcreateserial -days "$days" -sha256 -extfile "$dir/$name.ext" \
        -out "$dir/$name.pem" 2>/dev/null
    rm -f "$dir/$name.csr" "$dir/$name.ext"
    chmod 600 "$dir/$name.key"
    chmod 644 "$dir/$name.pem" "$dir/ca.pem"
    echo "$dir/$name.pem ($sans)"
done
