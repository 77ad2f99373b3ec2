//! The crash-consistency proof, in CI: every crash point once, and 50
//! random kills (`make chaos` runs 1,000). See `tests/chaos/driver.rs`.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

mod driver;
mod points;

#[test]
fn no_kill_loses_doubles_or_misreports_a_vm() {
    let kills = std::env::var("EITRI_CHAOS_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(50);

    // Guest networking on, in a network namespace of the test's own.
    eitri_agent::testkit::net::private_network();
    let summary = driver::run(kills);

    println!("{}", summary.line());
    assert!(
        summary.violations.is_empty(),
        "{}\n{}",
        summary.line(),
        summary.violations.join("\n")
    );
}
