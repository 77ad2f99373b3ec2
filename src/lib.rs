//! eitri-agent: the host agent of a microVM platform.
//!
//! One agent runs on every host. It reads the host's desired state (a
//! snapshot from a control plane, or a local file), drives the host toward
//! it through a hypervisor backend (cloud-hypervisor on Linux, vfkit on
//! macOS), and reports what the host actually has, truthfully, while the
//! host, the network or the agent itself fails. This page is the map; each
//! module's header states its own protocol.
//!
//! # Modules, by layer
//!
//! A module imports only from its own layer or below, and no two modules
//! (nor two files of one folder) import each other in a circle;
//! `tests/layers.rs` holds both.
//!
//! | layer | module | owns |
//! |---|---|---|
//! | 0 | [`model`] | checked domain types: ids, specs, power states, phases, rows, quota |
//! | 0 | [`error`], [`deadline`] | what every fallible, blocking call shares: permanence, error chains, pass deadlines |
//! | 0 | [`threads`] | the one thread-ownership idiom (owned and joined within a bound, or detached by reason) |
//! | 0 | [`crash`], [`stages`], [`metrics`] | named crash points (`make chaos`), a create's timed stages, counters |
//! | 0 | [`human`], [`quote`], [`hex`], [`base64`], [`logonce`], [`version`], [`programs`], [`trust`], [`rng`] | words for people, untrusted text made printable, encoders, log-once, release order, host programs found once, the keys that sign desired state, a reproducible generator for jitter and tests |
//! | 1 | [`state`] | the crash-safe state directory: its [`Layout`](state::Layout), the record store, leases, and the VM [`lifecycle`](state::lifecycle) whose fields only its transitions write |
//! | 1 | [`pb`] | wire types generated from `proto/`, and their validating conversion to [`model`] |
//! | 2 | [`provision`] | the hypervisor seam: the shared [`supervise`](provision::supervise) layer, and the `cloudhv` and [`vfkit`](provision::vfkit) backends |
//! | 2 | [`net`] | the underlay: addresses, the port guard, DHCP, the second NIC's snooper |
//! | 2 | [`guest`] | the guest agent's exchange over vsock: its framing, the host's questions, the checks every answer passes, and the guest's side (`eitri-guest`) |
//! | 2 | [`image`], [`seed`], [`disk`], [`hostkey`] | the artifacts of a create: base images, the NoCloud seed, root disks, guest host keys |
//! | 3 | [`usage`] | what each running VM uses (CPU, memory, disk, network), sampled on its own thread |
//! | 3 | [`reconcile`] | the engine: `Engine::step` routes a snapshot to one worker thread per VM and collects their rows; a VM's pass is the spine's numbered steps (`reconcile/step.rs`), each verb a file of its own |
//! | 4 | [`source`], [`config`], [`status`], [`console`] | desired state in, flags in, the report file and its rendering, a VM's console |
//! | 5 | [`daemon`] | the main loop, and the one place the real parts are wired |
//! | 6 | [`cli`], `testkit` | the subcommands `main` dispatches to; the fakes of every seam (built only with the `testkit` feature) |
//!
//! # Threads
//!
//! | thread | does | may wait on |
//! |---|---|---|
//! | `main` | steps the engine on new desired state and every tick; writes the report | nothing slow: a step never waits on a VM |
//! | `source` | the exchange with the control plane (or the desired file) | the network, bounded by `--request-timeout` |
//! | `desired-watch` | inotify on the desired file's directory | the kernel |
//! | `router` | rings the workers' doorbells after a step, a chunk at a time | nothing |
//! | `vm-<id>` | one VM's reconcile passes, one at a time | the hypervisor, the disk, downloads, each bounded by `--vm-timeout` |
//! | `reap-<id>` | waits for a VM's hypervisor (a child) to exit (detached: it outlives the engine) | the child |
//! | `vmm-exits` | pidfds of hypervisors adopted after a restart | the kernel |
//! | `image-<sha8>` | one base image's download, shared by every pass that waits for it (detached) | the network, bounded by `--image-stall-timeout` |
//! | `image-hash` | hashes a download's blocks beside it, joined by it | nothing |
//! | `reserve-<id>`, `lease-<id>` | a create's host share (address, VMM id) beside its attempt's save: durable writes made at once share journal commits; joined by the pass | the save |
//! | `seed-<id>`, `record-<id>` | a create's seed and its record's fsync, beside its root disk; joined by the pass | the disk |
//! | `sync-<id>` | makes a create's root disk and seed durable while its VMM boots; joined by the pass | the disk |
//! | `intent-<id>` | saves a resume's record while its guest is restored, held paused; joined by the pass | the disk |
//! | `sleepers` | polls sleeping VMs' NICs for the frame that wakes them, and running ones' frame counters for idleness | the kernel |
//! | `vmm-record` | records a VMM held before its exec (its pidfile) while it enters its jail; joined by the start | the disk |
//! | `netns-spare` | makes network namespaces ahead, one per VMM to come | nothing (two kept ready) |
//! | `plug-<id>` | joins a new VM's taps to the host's networks while its VMM starts, joined by the boot | netlink, `nft` |
//! | `serial-bound` | holds each VM's `serial.log` to `--serial-log-max-mb` | nothing |
//! | `dhcp-<tap>`, `snoop-<tap>` | a guest's DHCP responder; the second NIC's snooper | the tap |
//! | `learned-writer` | writes the second NICs' learned addresses, at most once a second | the disk |
//! | `usage` | reads each running VM's CPU, memory and device counters every `--usage-interval` | each VMM's API, 0.5 s per VM at most |
//! | `signals` | SIGTERM/SIGINT/SIGHUP as events for `main` | signals |
//!
//! # Threat model
//!
//! The agent runs as root, and everything it is handed may be hostile:
//! - **Guests** own every frame on their NICs, their DHCP client, ARP and
//!   serial output, and the bytes of their disks and volumes.
//! - **The control plane** (or anyone on the plain-HTTP path to it)
//!   controls every field of a snapshot: ids, URLs, digests, user-data,
//!   keys, sizes. Each is validated before it touches the host.
//! - **A guest that has taken over its VMM** holds that process: its uid,
//!   its fds (API socket, taps), the files it was given, whatever syscalls
//!   its jail leaves. It must reach no other VM and no host service, no
//!   more disk than its bounds, and nothing it sends the agent may cost the
//!   agent more than a bounded amount. It must not outlive its VM.
//! - **Local users** must read nothing under the state dir and run dir.
//!
//! Hence every VMM in a jail (its own uid and cgroups, no capabilities,
//! no_new_privs, Landlock, fds and environment cleaned), disks passed raw
//! with backing files off, `file://` images only under an operator-named
//! root, a port guard and an egress policy on every tap, caps on every size
//! and count from the wire, and untrusted text quoted when printed.

pub mod base64;
pub mod cli;
pub mod config;
pub mod console;
pub mod crash;
pub mod daemon;
pub mod deadline;
pub mod disk;
pub mod error;
pub mod events;
pub mod guest;
pub mod hex;
pub mod hostkey;
pub mod human;
pub mod image;
pub mod logonce;
pub mod metrics;
pub mod model;
pub mod net;
pub mod pb;
pub mod programs;
pub mod provision;
pub mod quote;
pub mod reconcile;
pub mod rng;
pub mod seed;
pub mod source;
pub mod stages;
pub mod state;
pub mod status;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod threads;
pub mod trust;
pub mod usage;
pub mod version;
