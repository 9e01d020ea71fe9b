"""`substrate.sandbox.parsers` and `substrate.layer.mounts.mountinfo` (pure): kernel texts
captured from this project's engine host (dockerd 20.10, cgroup v1 + an empty unified
hierarchy, runc and runsc) and a cgroup v2 host."""

from __future__ import annotations

import msgspec
import pytest

from substrate.layer.mounts import mountinfo
from substrate.sandbox import observe
from substrate.sandbox import parsers as P

CID = "1861239ebab313493267c5b96ef434c3764753482345831e678b0ea2ef797ce3"

# /proc/<pid>/status of `sleep` in a confined runc container (abridged to the lines read).
STATUS_RUNC = """\
Name:\tsleep
Umask:\t0022
State:\tS (sleeping)
Uid:\t1000\t1000\t1000\t1000
Gid:\t1000\t1000\t1000\t1000
Groups:\t1000\x20
CapInh:\t0000000000000000
CapPrm:\t0000000000000000
CapEff:\t0000000000000000
CapBnd:\t0000000000000000
CapAmb:\t0000000000000000
NoNewPrivs:\t1
Seccomp:\t2
Seccomp_filters:\t1
"""

# The gVisor sandbox process (State.Pid under runsc): nobody, in its own user namespace.
STATUS_RUNSC_SANDBOX = """\
Name:\texe
Uid:\t65534\t65534\t65534\t65534
Gid:\t65534\t65534\t65534\t65534
CapInh:\t0000000000240000
CapPrm:\t0000000000240000
CapEff:\t0000000000240000
CapBnd:\t000001ffffffffff
CapAmb:\t0000000000240000
NoNewPrivs:\t1
Seccomp:\t2
Seccomp_filters:\t1
"""

# A default `docker run` (root, engine default capabilities + NET_ADMIN, no NNP).
STATUS_WEAK = """\
Uid:\t0\t0\t0\t0
Gid:\t0\t0\t0\t0
CapPrm:\t00000000a80435fb
CapEff:\t00000000a80435fb
CapBnd:\t00000000a80435fb
CapAmb:\t0000000000000000
NoNewPrivs:\t0
Seccomp:\t2
"""

MOUNTINFO_RUNC = f"""\
124 58 0:46 / / ro,relatime master:3 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/X2TN:/var/lib/docker/overlay2/l/HUDI,upperdir=/var/lib/docker/overlay2/98d5/diff,workdir=/var/lib/docker/overlay2/98d5/work
125 124 0:49 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
126 124 0:50 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
127 126 0:51 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
128 124 0:52 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
129 128 0:53 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
133 129 0:32 /docker/{CID} /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory
139 129 0:36 /docker/{CID} /sys/fs/cgroup/pids ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,pids
141 126 0:48 / /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw
142 126 0:54 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
143 124 254:0 /tmp/fws /workspace rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
144 124 0:55 / /tmp rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,size=65536k
145 143 254:0 /tmp/fws/.git /workspace/.git ro,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
146 124 254:0 /var/lib/docker/containers/{CID}/resolv.conf /etc/resolv.conf ro,relatime - ext4 /dev/vda rw,discard
59 125 0:49 /bus /proc/bus ro,nosuid,nodev,noexec,relatime - proc proc rw
64 125 0:56 / /proc/acpi ro,relatime - tmpfs tmpfs ro
65 125 0:50 /null /proc/keys rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
79 128 0:57 / /sys/firmware ro,relatime - tmpfs tmpfs ro
"""

CGROUP_V1 = f"""\
9:name=systemd:/docker/{CID}
8:pids:/docker/{CID}
7:blkio:/docker/{CID}
4:memory:/docker/{CID}
1:cpu:/docker/{CID}
0::/docker/{CID}
"""

# The daemon's own mountinfo, cgroup lines: v1 controllers plus an empty unified tree.
HOST_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

# A systemd-driver cgroup v2 host (Debian 12 style).
CGROUP_V2 = "0::/system.slice/docker-" + CID + ".scope\n"
HOST_MOUNTINFO_V2 = (
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)


def route(**kw: object) -> P.Route:
    base: dict[str, object] = {
        "family": 2,
        "table": 254,
        "type": 1,
        "dst": None,
        "dst_len": 0,
        "gateway": None,
        "oif": "eth0",
    }
    return msgspec.convert({**base, **kw}, P.Route)


def test_parse_status_confined_runc() -> None:
    st = P.parse_status(STATUS_RUNC)
    assert st.no_new_privs is True
    assert st.seccomp_mode == 2
    assert st.cap_eff == st.cap_prm == st.cap_bnd == st.cap_amb == []
    assert st.uids == (1000, 1000, 1000, 1000)
    assert P.one_id(st.uids) == 1000


def test_parse_status_runsc_sandbox() -> None:
    st = P.parse_status(STATUS_RUNSC_SANDBOX)
    assert st.cap_eff == ["SYS_ADMIN", "SYS_CHROOT"]
    assert st.cap_bnd == sorted(P.CAP_NAMES)
    assert len(st.cap_bnd) == 41  # bits 0..40, CAP_CHECKPOINT_RESTORE the last
    assert P.one_id(st.uids) == 65534


def test_parse_status_engine_defaults_decode_to_the_engine_default_set() -> None:
    st = P.parse_status(STATUS_WEAK)
    assert set(st.cap_eff) == observe.ENGINE_DEFAULT_CAPS | {"NET_ADMIN"}
    assert st.no_new_privs is False
    assert P.one_id(st.uids) == 0


def test_parse_status_missing_lines_are_none() -> None:
    st = P.parse_status("Name:\tx\n")
    assert st.no_new_privs is None and st.seccomp_mode is None and st.uids == ()
    assert P.one_id(st.uids) is None


def test_parse_status_field() -> None:
    assert P.parse_status_field("Name:\tsleep\nPPid:\t4242\n", "PPid") == "4242"
    assert P.parse_status_field(STATUS_RUNC, "PPid") is None


def test_cap_names_unknown_bits_and_split_ids() -> None:
    assert P.cap_names((1 << 41) | 1) == ["CAP_41", "CHOWN"]
    assert P.cap_names(0) == []
    assert P.one_id((1000, 0, 0, 0)) == "1000/0/0/0"


def test_parse_mountinfo_confined_container() -> None:
    mounts = mountinfo.parse_mountinfo(MOUNTINFO_RUNC)
    top = P.topmost(mounts)
    assert P.rootfs_readonly(mounts) is True
    assert top["/"].fstype == "overlay" and "ro" in top["/"].options
    assert top["/workspace"].root == "/tmp/fws" and top["/workspace"].source == "/dev/vda"
    assert top["/tmp"].super_options == ("rw", "size=65536k")
    assert P.workspace_view(
        ((m.mount_point, m.read_only) for m in mountinfo.visible_mounts(mounts)), "/workspace"
    ) == (
        "rw",
        [".git"],
    )
    # /dev, /dev/shm, /sys/fs/cgroup, /proc/keys are the runtime's, not the profile's.
    assert P.tmpfs_facts(mounts) == ["/tmp=67108864"]


def test_parse_mountinfo_decodes_octal_escapes_and_super_ro() -> None:
    text = "50 40 254:0 /srv/my\\040work\\134x /workspace/a\\011b rw - ext4 /dev/vda ro,errors=remount\n"
    (m,) = mountinfo.parse_mountinfo(text)
    assert m.root == "/srv/my work\\x"
    assert m.mount_point == "/workspace/a\tb"
    assert m.read_only  # read-only superblock, even with a rw mount
    with pytest.raises(ValueError, match="separator"):
        mountinfo.parse_mountinfo("1 2 3:4 / / rw shared:1 ext4 /dev/x rw\n")


def test_visible_mounts_follow_the_mount_tree() -> None:
    text = (
        "1 0 0:1 / / ro - overlay overlay rw\n"
        "2 1 0:2 /ws /workspace rw - ext4 /dev/vda rw\n"
        "3 2 0:2 /ws/.git /workspace/.git ro - ext4 /dev/vda rw\n"
        # A second workspace mount stacked on the first hides the first one's .git,
        # wherever it appears in the list.
        "4 2 0:2 /other /workspace rw - ext4 /dev/vda rw\n"
    )
    mounts = mountinfo.parse_mountinfo(text)
    assert [m.mount_id for m in mountinfo.visible_mounts(mounts)] == [1, 4]
    reordered = [mounts[3], mounts[0], mounts[2], mounts[1]]
    assert [m.mount_id for m in mountinfo.visible_mounts(reordered)] == [4, 1]
    assert P.topmost(mounts)["/workspace"].root == "/other"
    # The real container's mounts are all visible.
    real = mountinfo.parse_mountinfo(MOUNTINFO_RUNC)
    assert mountinfo.visible_mounts(real) == real


def test_workspace_view_shapes() -> None:
    view = P.workspace_view
    assert view([("/", True)], "/workspace") == ("absent", [])
    assert view([("/workspace", True)], "/workspace") == ("ro", [])
    # A writable hole inside a read-only workspace.
    assert view([("/workspace", True), ("/workspace/out", False)], "/workspace")[0] == "mixed"
    # A read-only .git with a writable mount under it does not count as read-only.
    assert view(
        [("/workspace", False), ("/workspace/.git", True), ("/workspace/.git/hooks", False)],
        "/workspace",
    ) == ("rw", [])
    # A later mount on the target hides what was mounted under the earlier one.
    assert view(
        [("/workspace", False), ("/workspace/.git", True), ("/workspace", False)], "/workspace"
    ) == ("rw", [])


def test_parse_cgroup_and_find_v1_dirs() -> None:
    groups = P.parse_cgroup(CGROUP_V1)
    assert groups["memory"] == f"/docker/{CID}" and groups["name=systemd"] == f"/docker/{CID}"
    assert groups[""] == f"/docker/{CID}"
    host = mountinfo.parse_mountinfo(HOST_MOUNTINFO)
    # Hybrid host: the v1 hierarchy wins over the (controller-less) unified one.
    assert P.cgroup_dir("memory", groups, host) == ("v1", f"/sys/fs/cgroup/memory/docker/{CID}")
    assert P.cgroup_dir("pids", groups, host) == ("v1", f"/sys/fs/cgroup/pids/docker/{CID}")
    assert P.cgroup_dir("cpu", groups, host) == ("v1", f"/sys/fs/cgroup/cpu/docker/{CID}")
    assert P.parse_cgroup("3:cpu,cpuacct:/a\n")["cpuacct"] == "/a"


def test_cgroup_dir_v2_and_namespaced_paths() -> None:
    host = mountinfo.parse_mountinfo(HOST_MOUNTINFO_V2)
    assert P.cgroup_dir("memory", P.parse_cgroup(CGROUP_V2), host) == (
        "v2",
        f"/sys/fs/cgroup/system.slice/docker-{CID}.scope",
    )
    # A path outside the reader's cgroup namespace cannot be found under its mounts.
    assert P.cgroup_dir("memory", {"": "/../other"}, host) is None
    # A hierarchy mounted from a sub-path (the reader is itself in a container).
    sub = mountinfo.parse_mountinfo(
        "1 0 0:1 /docker /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    )
    assert P.cgroup_dir("memory", {"memory": "/docker/abc"}, sub) == (
        "v1",
        "/sys/fs/cgroup/memory/abc",
    )
    assert P.cgroup_dir("memory", {"memory": "/elsewhere"}, sub) is None


def test_cgroup_value_parsers() -> None:
    assert P.parse_memory_limit_v1("268435456\n") == 268435456
    assert P.parse_memory_limit_v1("9223372036854771712\n") is None
    assert P.parse_max("64\n") == 64
    assert P.parse_max("max\n") is None
    assert P.parse_cpu_v1("150000\n", "100000\n") == 1.5
    assert P.parse_cpu_v1("-1\n", "100000\n") is None
    assert P.parse_cpu_max("200000 100000\n") == 2.0
    assert P.parse_cpu_max("max 100000\n") is None
    with pytest.raises(ValueError):
        P.parse_max("lots")


def test_outside_routes() -> None:
    bridge = [
        route(gateway="172.17.0.1"),
        route(dst="172.17.0.0", dst_len=16),
        route(table=255, type=2, dst="127.0.0.1", dst_len=32, oif="lo"),
        route(table=255, type=2, dst="172.17.0.2", dst_len=32),
    ]
    assert P.outside_routes(bridge) == [
        "inet 0.0.0.0/0 via 172.17.0.1 dev eth0 table 254",
        "inet 172.17.0.0/16 dev eth0 table 254",
    ]
    only_lo = [
        route(table=255, type=2, dst="127.0.0.0", dst_len=8, oif="lo"),
        route(family=10, dst="::1", dst_len=128, oif="lo"),  # IPv6 keeps ::1 in main
        route(family=10, type=7, dst=None, dst_len=0, oif="lo"),  # unreachable default
    ]
    assert P.outside_routes(only_lo) == []
    assert P.outside_routes([route(family=10, dst=None, gateway="fe80::1")]) == [
        "inet6 ::/0 via fe80::1 dev eth0 table 254"
    ]


#: /proc/<pid>/net/tcp of an egress sandbox: the daemon's listener, a command's
#: connection to it and the daemon's accepted end (as read from a real container).
NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0C38 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2226741 1 00000000187e77b8 100 0 0 10 0
   1: 0100007F:B182 0100007F:0C38 01 00000000:00000000 00:00000000 00000000  1000        0 2227622 2 0000000091051cf6 20 0 0 10 -1
   2: 0100007F:0C38 0100007F:B182 01 00000000:00000000 00:00000000 00000000     0        0 2227585 1 000000000532a292 20 0 0 10 -1
"""
NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 99 1 0000000000000000 100 0 0 10 0
"""


def test_parse_proc_net_tcp() -> None:
    listener, client, accepted = P.parse_proc_net_tcp(NET_TCP)
    assert listener == P.TcpSocket(
        local="127.0.0.1:3128", remote="0.0.0.0:0", state=P.TCP_LISTEN, uid=0, inode=2226741
    )
    assert (client.local, client.remote, client.uid, client.inode) == (
        "127.0.0.1:45442",
        "127.0.0.1:3128",
        1000,
        2227622,
    )
    assert accepted.local == "127.0.0.1:3128"
    (v6,) = P.parse_proc_net_tcp(NET_TCP6)
    assert (v6.local, v6.state, v6.uid) == ("::1:8080", P.TCP_LISTEN, 1000)
    assert P.parse_proc_net_tcp(NET_TCP.splitlines()[0]) == []
    with pytest.raises(ValueError):
        P.parse_proc_net_tcp(NET_TCP.replace("0100007F:B182", "01007F:B182"))
