//! Every setting of `run`: flag, environment variable, default, meaning.
//! `--help` is generated from this table, so it cannot drift.

/// One setting: its flag, its environment variable, its default and what it
/// means. The help text is generated from this table, so it cannot drift.
pub(super) struct Setting {
    pub flag: &'static str,
    pub env: &'static str,
    pub default: &'static str,
    pub help: &'static str,
}

pub(super) const SETTINGS: &[Setting] = &[
    Setting {
        flag: "state-dir",
        env: "EITRI_STATE_DIR",
        default: "/var/lib/eitri",
        help: "directory holding records, images, volumes and report.json",
    },
    Setting {
        flag: "desired",
        env: "EITRI_DESIRED",
        default: "",
        help: "standalone mode: read the desired Snapshot as JSON from this file (re-read when it changes)",
    },
    Setting {
        flag: "control-plane",
        env: "EITRI_CONTROL_PLANE",
        default: "",
        help: "base URL of the control plane, e.g. http://cp.internal:8080",
    },
    Setting {
        flag: "token-file",
        env: "EITRI_TOKEN_FILE",
        default: "",
        help: "file holding the bearer token for the control plane",
    },
    Setting {
        flag: "host-id",
        env: "EITRI_HOST_ID",
        default: "",
        help: "this host's id (default: /etc/machine-id, else the hostname)",
    },
    Setting {
        flag: "tick",
        env: "EITRI_TICK",
        default: "5s",
        help: "how often desired state is fetched and the host reconciled",
    },
    Setting {
        flag: "connect-timeout",
        env: "EITRI_CONNECT_TIMEOUT",
        default: "5s",
        help: "control plane: TCP connect timeout",
    },
    Setting {
        flag: "request-timeout",
        env: "EITRI_REQUEST_TIMEOUT",
        default: "30s",
        help: "control plane: whole-request timeout",
    },
    Setting {
        flag: "max-response-bytes",
        env: "EITRI_MAX_RESPONSE_BYTES",
        default: "16777216",
        help: "largest snapshot read, in bytes: a control plane's answer or the desired file",
    },
    Setting {
        flag: "max-vms",
        env: "EITRI_MAX_VMS",
        default: "10000",
        help: "most VM entries one snapshot may hold; counted before it is decoded",
    },
    Setting {
        flag: "max-volumes",
        env: "EITRI_MAX_VOLUMES",
        default: "10000",
        help: "most volume entries one snapshot may hold; counted before it is decoded",
    },
    Setting {
        flag: "proxy",
        env: "EITRI_PROXY",
        default: "",
        help: "HTTP proxy for the control plane and image downloads (http_proxy and the like are ignored)",
    },
    Setting {
        flag: "backoff-max",
        env: "EITRI_BACKOFF_MAX",
        default: "60s",
        help: "control plane: longest wait between failed contacts",
    },
    Setting {
        flag: "max-vcpus",
        env: "EITRI_MAX_VCPUS",
        default: "0",
        help: "host cap on vCPUs committed to VMs (0 = unlimited)",
    },
    Setting {
        flag: "max-mem-mb",
        env: "EITRI_MAX_MEM_MB",
        default: "0",
        help: "host cap on guest memory in MiB (0 = unlimited)",
    },
    Setting {
        flag: "max-disk-gb",
        env: "EITRI_MAX_DISK_GB",
        default: "0",
        help: "host cap on root disks in GiB (0 = unlimited)",
    },
    Setting {
        flag: "max-concurrent-creates",
        env: "EITRI_MAX_CONCURRENT_CREATES",
        default: "4",
        help: "creates allowed in their I/O-heavy part at once (0 = unlimited)",
    },
    Setting {
        flag: "vm-timeout",
        env: "EITRI_VM_TIMEOUT",
        default: "15m",
        help: "bound on one VM's reconcile pass (0 = none)",
    },
    Setting {
        flag: "tombstone-grace",
        env: "EITRI_TOMBSTONE_GRACE",
        default: "1h",
        help: "quarantine before a tombstoned VM is destroyed",
    },
    Setting {
        flag: "vanish-grace",
        env: "EITRI_VANISH_GRACE",
        default: "24h",
        help: "quarantine before a VM gone from desired state is destroyed",
    },
    Setting {
        flag: "max-create-attempts",
        env: "EITRI_MAX_CREATE_ATTEMPTS",
        default: "3",
        help: "create attempts per spec before the VM is failed for good",
    },
    Setting {
        flag: "hypervisor",
        env: "EITRI_HYPERVISOR",
        default: "cloud-hypervisor",
        help: "hypervisor binary (a path, or a name looked up in PATH)",
    },
    Setting {
        flag: "kernel",
        env: "EITRI_KERNEL",
        default: "",
        help: "guest kernel (PVH ELF) to boot; give this or --firmware",
    },
    Setting {
        flag: "firmware",
        env: "EITRI_FIRMWARE",
        default: "",
        help: "guest firmware (e.g. hypervisor-fw, CLOUDHV.fd) to boot",
    },
    Setting {
        flag: "cmdline",
        env: "EITRI_CMDLINE",
        default: "console=ttyS0 root=/dev/vda1 rw",
        help: "guest kernel command line (with --kernel)",
    },
    Setting {
        flag: "underlay-bridge",
        env: "EITRI_UNDERLAY_BRIDGE",
        default: "eitri0",
        help: "the agent's bridge for guest NICs (empty: no guest networking)",
    },
    Setting {
        flag: "underlay-subnet",
        env: "EITRI_UNDERLAY_SUBNET",
        default: "100.77.0.0/16",
        help: "guest underlay subnet; the bridge takes its first address",
    },
    Setting {
        flag: "host-network",
        env: "EITRI_HOST_NETWORK",
        default: "",
        help: "named host networks for a VM's second NIC: NAME=BRIDGE[,NAME=BRIDGE] (default: none)",
    },
    Setting {
        flag: "guest-dns",
        env: "EITRI_GUEST_DNS",
        default: "",
        help: "DNS servers told to guests, comma-separated (default: the host's non-loopback resolvers)",
    },
    Setting {
        flag: "run-dir",
        env: "EITRI_RUN_DIR",
        default: "/run/eitri",
        help: "directory for hypervisor API sockets (kept short: socket paths are limited to 108 bytes)",
    },
    Setting {
        flag: "tap-prefix",
        env: "EITRI_TAP_PREFIX",
        default: "eitri",
        help: "prefix of the agent's tap names; unheld taps with it are removed at start",
    },
    Setting {
        flag: "shutdown-grace",
        env: "EITRI_SHUTDOWN_GRACE",
        default: "30s",
        help: "on SIGTERM, how long in-flight passes may finish",
    },
    Setting {
        flag: "notify-fd",
        env: "EITRI_NOTIFY_FD",
        default: "",
        help: "write one newline to this fd once the first report is written (s6 readiness)",
    },
];
