#!/usr/bin/env bash
# Download Debian packages, as .deb files, from one Debian release into DIR, through a private
# apt configuration (the system's sources are never changed): what pos carries to hosts whose
# own packages are too old, or to an offline GPU machine (scripts/criu-debs.sh,
# scripts/podman-debs.sh name the packages).
#
#   scripts/debian-debs.sh RELEASE DIR PACKAGE...   # e.g. forky .device/criu criu libc6 ...
#   scripts/debian-debs.sh --mirror                 # only print the Debian mirror it would use
#
# The Debian mirror is the one this machine's apt already uses (so a host behind its own mirror
# works): the first enabled `deb` source of /etc/apt/sources.list and /etc/apt/sources.list.d/
# (one-line *.list and deb822 *.sources) that serves this Debian release's main suite.
# POS_DEBIAN_MIRROR=URL names one instead (hosts that are not Debian, e.g. Ubuntu);
# APT_ETC=DIR reads DIR/sources.list* instead of /etc/apt's (the tests).
set -euo pipefail
me=${POS_DEBS_NAME:-$(basename "$0" .sh)}   # the script that asked, in messages
if [ "${1:-}" = --mirror ]; then
  release=""
else
  release=${1:?usage: scripts/debian-debs.sh RELEASE DIR PACKAGE...|--mirror}
  dest=${2:?usage: scripts/debian-debs.sh RELEASE DIR PACKAGE...}
  shift 2
  pkgs=("$@")
fi

# The mirror of this host's Debian release in its apt sources (both formats), or nothing.
debian_mirror() {
  /usr/bin/python3 - "${APT_ETC:-/etc/apt}" <<'PY'
import glob, os, re, sys

etc = sys.argv[1]
os_release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', open("/etc/os-release").read(), re.M))
codename = os_release.get("VERSION_CODENAME", "") if os_release.get("ID") == "debian" else ""

def one_line(text):
    """(types, uris, suites) of each entry of a one-line .list file."""
    for line in text.splitlines():
        line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(line) >= 3:
            yield [line[0]], [line[1]], [line[2]]

def deb822(text):
    """(types, uris, suites) of each enabled stanza of a deb822 .sources file."""
    for stanza in re.split(r"\n\s*\n", text):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() != "no":
            yield (fields.get("types", "").split(), fields.get("uris", "").split(),
                   fields.get("suites", "").split())

files = [f"{etc}/sources.list"] + sorted(glob.glob(f"{etc}/sources.list.d/*.list")) \
    + sorted(glob.glob(f"{etc}/sources.list.d/*.sources"))
for path in files:
    if not os.path.isfile(path):
        continue
    parse = deb822 if path.endswith(".sources") else one_line
    for types, uris, suites in parse(open(path, errors="replace").read()):
        if "deb" in types and codename in suites:
            for uri in uris:
                if re.match(r"(https?|file):/", uri):
                    print(uri.rstrip("/"))
                    sys.exit(0)
PY
}
mirror=${POS_DEBIAN_MIRROR:-$(debian_mirror)}
[ -n "$mirror" ] || { echo "$me: this host's apt sources name no Debian mirror" \
  "(not a Debian host?): set POS_DEBIAN_MIRROR to the URL of a Debian mirror" >&2; exit 2; }
[ -z "$release" ] && { echo "$mirror"; exit 0; }
apt_dir=$(mktemp -d)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$dest"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $release main" \
  > "$apt_dir/sources.list"
touch "$apt_dir/status"   # this host's installed versions are not candidates (not in $release)
opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
      -o "Dir::State::status=$apt_dir/status")
apt-get "${opts[@]}" update -qq 2>&1 | grep -v '^W:' >&2 || true
rm -f "$dest"/*.deb
(cd "$dest" && apt-get "${opts[@]}" download -qq "${pkgs[@]}" 2>&1 | grep -v '^W:' >&2 || true)
for p in "${pkgs[@]}"; do
  ls "$dest/${p}_"*.deb >/dev/null 2>&1 || { echo "$me: $p was not downloaded from" \
    "Debian $release at $mirror" >&2; exit 1; }
done
