//! Every setting of `run`, defined once: its flag (which is also its key in
//! the config file), environment variable, default, meaning, and the
//! section it belongs to, in one table. The table makes the [`Key`] and
//! [`Section`] enums, so a setting is looked up by a key the compiler
//! checks (a typo does not build) and every key has exactly one row;
//! `--help`, the config file's keys and `eitri-agent config` are generated
//! from the same table, so they cannot drift. Each section is read by one
//! builder in `run.rs`, which turns it into the typed part of the config
//! its users take (see `Raw::section`).

/// One setting: its flag, its environment variable, its default, what it
/// means and where it goes.
pub struct Setting {
    pub flag: &'static str,
    pub env: &'static str,
    pub default: &'static str,
    pub help: &'static str,
    pub section: Section,
}

/// The hypervisor of this platform: cloud-hypervisor on Linux, vfkit on
/// macOS.
#[cfg(not(target_os = "macos"))]
const DEFAULT_HYPERVISOR: &str = "cloud-hypervisor";
#[cfg(target_os = "macos")]
const DEFAULT_HYPERVISOR: &str = "vfkit";

/// Where API sockets go: /run on Linux; macOS has no /run.
#[cfg(not(target_os = "macos"))]
const DEFAULT_RUN_DIR: &str = "/run/eitri";
#[cfg(target_os = "macos")]
const DEFAULT_RUN_DIR: &str = "/var/run/eitri";

macro_rules! settings {
    ($($section:ident { $name:literal, $title:literal, $about:literal } [
        $($key:ident => $flag:literal, $env:literal, $default:expr, $help:literal;)*
    ])*) => {
        /// A group of settings: a heading of `--help` and a section of the
        /// config file.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Section {
            $($section,)*
        }

        impl Section {
            /// Every section, in the order `--help` and `config` list them.
            pub const ALL: &[Section] = &[$(Section::$section,)*];

            /// Its name in the config file.
            pub fn name(self) -> &'static str {
                match self {
                    $(Section::$section => $name,)*
                }
            }

            /// Its heading in `--help`, and what its settings are about.
            pub fn title(self) -> (&'static str, &'static str) {
                match self {
                    $(Section::$section => ($title, $about),)*
                }
            }
        }

        /// A setting of `run`, by name.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Key {
            $($($key,)*)*
        }

        impl Key {
            /// Every key, section by section, in the order `--help` lists them.
            pub const ALL: &[Key] = &[$($(Key::$key,)*)*];

            pub fn setting(self) -> &'static Setting {
                match self {
                    $($(Key::$key => &Setting {
                        flag: $flag,
                        env: $env,
                        default: $default,
                        help: $help,
                        section: Section::$section,
                    },)*)*
                }
            }
        }
    };
}

settings! {
    Source { "source", "Desired state", "where desired state comes from, and the control plane" } [
        Desired => "desired", "EITRI_DESIRED", "",
            "standalone mode: read the desired Snapshot as JSON from this file (re-read when it changes)";
        ControlPlane => "control-plane", "EITRI_CONTROL_PLANE", "",
            "base URL of the control plane, e.g. http://cp.internal:8080";
        TokenFile => "token-file", "EITRI_TOKEN_FILE", "",
            "file holding the bearer token for the control plane";
        TrustedKeys => "trusted-keys", "EITRI_TRUSTED_KEYS", "",
            "file of the ed25519 keys desired state must be signed by, `ed25519 KEY-ID PUBLIC-KEY` a line (default: none; desired state is then unauthenticated)";
        TokenInClear => "token-in-clear", "EITRI_TOKEN_IN_CLEAR", "no",
            "yes: with --trusted-keys and an http:// control plane, send the token anyway, readable by anyone on the path";
        HostId => "host-id", "EITRI_HOST_ID", "",
            "this host's id (default: /etc/machine-id, else the hostname)";
        ConnectTimeout => "connect-timeout", "EITRI_CONNECT_TIMEOUT", "5s",
            "control plane: TCP connect timeout";
        RequestTimeout => "request-timeout", "EITRI_REQUEST_TIMEOUT", "30s",
            "control plane: whole-request timeout";
        BackoffMax => "backoff-max", "EITRI_BACKOFF_MAX", "60s",
            "control plane: longest wait between failed contacts";
        Proxy => "proxy", "EITRI_PROXY", "",
            "HTTP proxy for the control plane and image downloads (http_proxy and the like are ignored)";
        MaxResponseBytes => "max-response-bytes", "EITRI_MAX_RESPONSE_BYTES", "16777216",
            "largest snapshot read, in bytes: a control plane's answer or the desired file";
        MaxVms => "max-vms", "EITRI_MAX_VMS", "10000",
            "most VM entries one snapshot may hold; counted before it is decoded";
        MaxVolumes => "max-volumes", "EITRI_MAX_VOLUMES", "10000",
            "most volume entries one snapshot may hold; counted before it is decoded";
        MaxEpochStep => "max-epoch-step", "EITRI_MAX_EPOCH_STEP", "4294967296",
            "most an unsigned control plane's answer may raise the epoch by at once (a further one is refused, so a forged answer fences the real control plane out by no more than this); signed desired state moves it as it says";
    ]
    State { "state", "State", "where the agent keeps what it knows" } [
        StateDir => "state-dir", "EITRI_STATE_DIR", "/var/lib/eitri",
            "directory holding records, images, volumes and report.json";
        AgentsDir => "agents-dir", "EITRI_AGENTS_DIR", "/var/lib/eitri-agents",
            "host-wide record of each agent's VMM ids and cgroup root, so agents with different state dirs never share either";
    ]
    Reconcile { "reconcile", "Reconcile", "how often and how patiently the host is made to match" } [
        Tick => "tick", "EITRI_TICK", "5s",
            "how often desired state is fetched and the host reconciled";
        VmTimeout => "vm-timeout", "EITRI_VM_TIMEOUT", "15m",
            "bound on one VM's reconcile pass (0 = none)";
        TombstoneGrace => "tombstone-grace", "EITRI_TOMBSTONE_GRACE", "1h",
            "quarantine before a tombstoned VM is destroyed";
        VanishGrace => "vanish-grace", "EITRI_VANISH_GRACE", "24h",
            "quarantine before a VM gone from desired state is destroyed";
        MaxCreateAttempts => "max-create-attempts", "EITRI_MAX_CREATE_ATTEMPTS", "3",
            "create attempts per spec (10 s, 30 s, 90 s, ... apart) before the VM is failed";
        CreateRearm => "create-rearm", "EITRI_CREATE_REARM", "1h",
            "how long a create whose attempts all failed on errors that may pass (a server down, a full disk) waits before trying again";
        MaxConcurrentCreates => "max-concurrent-creates", "EITRI_MAX_CONCURRENT_CREATES", "4",
            "creates allowed in their I/O-heavy part at once (0 = unlimited)";
        ShutdownGrace => "shutdown-grace", "EITRI_SHUTDOWN_GRACE", "30s",
            "on SIGTERM, how long in-flight passes may finish";
    ]
    Network { "network", "Network", "the guests' bridge, addresses and what they may reach" } [
        UnderlayBridge => "underlay-bridge", "EITRI_UNDERLAY_BRIDGE", "eitri0",
            "the agent's bridge for guest NICs (empty or none: no guest networking)";
        UnderlaySubnet => "underlay-subnet", "EITRI_UNDERLAY_SUBNET", "100.77.0.0/16",
            "guest underlay subnet; the bridge takes its first address";
        TapPrefix => "tap-prefix", "EITRI_TAP_PREFIX", "eitri",
            "prefix of the agent's tap names; unheld taps with it are removed at start";
        HostNetwork => "host-network", "EITRI_HOST_NETWORK", "",
            "named host networks for a VM's second NIC: NAME=BRIDGE[,NAME=BRIDGE] (default: none)";
        GuestDns => "guest-dns", "EITRI_GUEST_DNS", "",
            "DNS servers told to guests, comma-separated (default: the host's non-loopback resolvers)";
        GuestDeny => "guest-deny", "EITRI_GUEST_DENY", "",
            "ranges guests and image downloads may not reach, CIDR,CIDR (besides this host, 169.254.0.0/16, other guests and the control plane, always refused): list the management LAN here; an IPv6 range binds downloads (guests have no IPv6)";
        GuestAllow => "guest-allow", "EITRI_GUEST_ALLOW", "",
            "ranges guests may reach even where refused (this host's addresses, link-local, --guest-deny), CIDR,CIDR";
        PublishPorts => "publish-ports", "EITRI_PUBLISH_PORTS", "",
            "host ports a VM's entry may publish to its guest, FIRST-LAST (default: none, so no port is published)";
    ]
    Images { "images", "Images", "how base images are fetched and cached" } [
        ImageRoot => "image-root", "EITRI_IMAGE_ROOT", "",
            "directory file:// images must be under (default: none, so file:// images are refused)";
        ImageAllow => "image-allow", "EITRI_IMAGE_ALLOW", "",
            "ranges image URLs may reach although refused (loopback, link-local, unique-local IPv6, this host's addresses, --guest-deny), IPv4 or IPv6 CIDR,CIDR: an image mirror on the management LAN";
        ImageStallTimeout => "image-stall-timeout", "EITRI_IMAGE_STALL_TIMEOUT", "60s",
            "an image download that receives nothing this long fails (and is retried afresh)";
        ImageDownloadTimeout => "image-download-timeout", "EITRI_IMAGE_DOWNLOAD_TIMEOUT", "1h",
            "an image download still running after this long fails (and is retried afresh)";
        ImageMinRate => "image-min-rate-kib", "EITRI_IMAGE_MIN_RATE_KIB", "64",
            "an image download averaging fewer KiB/s than this over one --image-stall-timeout fails (0: no minimum)";
        ImageCacheMax => "image-cache-max", "EITRI_IMAGE_CACHE_MAX", "25%",
            "most disk the image cache may hold, e.g. 200G, 500M or 25% (of the state dir's filesystem): past it, images no VM uses and desired state does not name are deleted, oldest first (0: no cap)";
    ]
    Hypervisor { "hypervisor", "Hypervisor", "what runs a guest and how it boots" } [
        Hypervisor => "hypervisor", "EITRI_HYPERVISOR", DEFAULT_HYPERVISOR,
            "hypervisor binary (a path, or a name looked up in PATH)";
        Kernel => "kernel", "EITRI_KERNEL", "",
            "guest kernel (PVH ELF) to boot; give this or --firmware";
        Firmware => "firmware", "EITRI_FIRMWARE", "",
            "guest firmware (e.g. hypervisor-fw, CLOUDHV.fd) to boot";
        Cmdline => "cmdline", "EITRI_CMDLINE", "console=ttyS0 root=/dev/vda1 rw",
            "guest kernel command line (with --kernel)";
        RunDir => "run-dir", "EITRI_RUN_DIR", DEFAULT_RUN_DIR,
            "directory for hypervisor API sockets (kept short: socket paths are limited to 108 bytes)";
        StopGrace => "stop-grace", "EITRI_STOP_GRACE", "30s",
            "how long a guest is given to power off after the power button before its hypervisor is told to stop";
        GuestAgent => "guest-agent", "EITRI_GUEST_AGENT", "",
            "the guest agent every new VM's seed carries, installed and started by cloud-init (a static eitri-guest): empty, eitri-guest beside this agent's binary when it is there; off: none";
        GuestHugepages => "guest-hugepages", "EITRI_GUEST_HUGEPAGES", "no",
            "yes: back each new guest's memory with 2 MiB huge pages from the host's reserved pool (sysctl vm.nr_hugepages), so a resumed guest faults its memory in 2 MiB at a time, not 4 KiB, and a wake answers sooner; guests then take their memory from the pool only, which --max-mem-mb auto counts instead (cloud-hypervisor only)";
    ]
    Jail { "jail", "Jail", "who a hypervisor runs as and what it may touch" } [
        VmmIds => "vmm-ids", "EITRI_VMM_IDS", "1900000000:65536",
            "FIRST:COUNT user and group ids for jailed hypervisors: FIRST is the group that may open /dev/kvm, each VM gets one of the rest (default: this range for the default state dir, else a range of its own)";
        KvmDevice => "kvm-device", "EITRI_KVM_DEVICE", "/dev/kvm",
            "the KVM device the hypervisors' group is given read-write access to (an ACL entry when it lacks it)";
        UserfaultfdDevice => "userfaultfd-device", "EITRI_USERFAULTFD_DEVICE", "/dev/userfaultfd",
            "the device a resuming hypervisor faults its guest's memory in through, given to the hypervisors' group like the KVM device at the first resume and seen only by a hypervisor that resumes (empty: resumes read the whole snapshot first)";
        CgroupRoot => "cgroup-root", "EITRI_CGROUP_ROOT", "eitri",
            "cgroup (in each hierarchy) under which each VM's hypervisor gets its own (default: eitri for the default state dir, else one of its own, eitri-N)";
        AllowWithout => "allow-without", "EITRI_ALLOW_WITHOUT", "",
            "pieces of confinement hypervisors may run without where this host lacks them: jail, cgroups, landlock (comma-separated; default none)";
    ]
    Limits { "limits", "Limits", "what the host commits, and what a VM whose spec sets none may use" } [
        MaxVcpus => "max-vcpus", "EITRI_MAX_VCPUS", "0",
            "host cap on vCPUs committed to VMs (0 = unlimited)";
        MaxMemMb => "max-mem-mb", "EITRI_MAX_MEM_MB", "auto",
            "host cap on guest memory in MiB (auto: this host's memory less a tenth, at least 1 GiB, kept for itself; 0 = unlimited)";
        MaxDiskGb => "max-disk-gb", "EITRI_MAX_DISK_GB", "0",
            "host cap on root disks in GiB (0 = unlimited)";
        VmCpuMaxPerVcpu => "vm-cpu-max-millis-per-vcpu", "EITRI_VM_CPU_MAX_MILLIS_PER_VCPU", "0",
            "hard CPU cap of a VM whose spec sets none, in thousandths of a CPU per vCPU: 1000 holds each vCPU to one CPU's time (0: no cap, only a weight)";
        VmCpuBurst => "vm-cpu-burst-ms", "EITRI_VM_CPU_BURST_MS", "0",
            "CPU time per 100 ms a capped VM whose spec sets none may spend above its cap out of what it left unused (0: none)";
        VmDiskMbps => "vm-disk-mbps", "EITRI_VM_DISK_MBPS", "0",
            "disk bandwidth of a VM whose spec sets none, MB/s across its root disk and volumes (0: unlimited)";
        VmDiskIops => "vm-disk-iops", "EITRI_VM_DISK_IOPS", "0",
            "disk operations a second of a VM whose spec sets none, across its root disk and volumes (0: unlimited)";
        VmNetMbps => "vm-net-mbps", "EITRI_VM_NET_MBPS", "0",
            "NIC bandwidth of a VM whose spec sets none, Mbit/s each way on each NIC (0: unlimited)";
        SerialLogMaxMb => "serial-log-max-mb", "EITRI_SERIAL_LOG_MAX_MB", "16",
            "disk a guest's serial output may hold, in MiB: older output is freed once a second (the newest half is kept)";
    ]
    Reporting { "reporting", "Reporting", "what the agent tells besides report.json" } [
        MetricsFile => "metrics-file", "EITRI_METRICS_FILE", "",
            "write metrics in the Prometheus text format to this file every tick, for node_exporter's textfile collector (default: off)";
        NotifyFd => "notify-fd", "EITRI_NOTIFY_FD", "",
            "write one newline to this fd once the first report is written (s6 readiness)";
        UsageInterval => "usage-interval", "EITRI_USAGE_INTERVAL", "10s",
            "how often each running VM's CPU, memory, disk and network are sampled, for top, status and the metrics file (0: never)";
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_setting_is_defined_once() {
        let flags: HashSet<_> = Key::ALL.iter().map(|k| k.setting().flag).collect();
        let envs: HashSet<_> = Key::ALL.iter().map(|k| k.setting().env).collect();
        let sections: HashSet<_> = Section::ALL.iter().map(|s| s.name()).collect();

        assert_eq!(flags.len(), Key::ALL.len());
        assert_eq!(envs.len(), Key::ALL.len());
        assert_eq!(sections.len(), Section::ALL.len());
        // The config file's own flag is no setting's.
        assert!(!flags.contains("config"));
        assert!(
            Section::ALL
                .iter()
                .all(|s| Key::ALL.iter().any(|k| k.setting().section == *s))
        );
        assert!(Key::ALL.iter().all(|k| k.setting().env
            == format!(
                "EITRI_{}",
                k.setting().flag.to_uppercase().replace('-', "_")
            )));
    }
}
