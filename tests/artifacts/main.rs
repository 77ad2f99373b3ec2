//! What the agent writes and reads, in-process: for a VM (root disks, host
//! keys, images, seeds), for the host (the metrics file), and on the wire
//! (the conversion, the DHCP codec), one module each, in one test crate.

mod clones;
mod disk;
mod fuzz_dhcp;
mod hostkey;
mod image;
mod metrics;
mod seed;
mod wire;
