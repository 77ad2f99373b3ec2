//! What the agent writes for a VM (root disks, host keys, images, seeds),
//! one module each, in one test crate.

mod disk;
mod hostkey;
mod image;
mod seed;
