//! `make chaos`: the crash-consistency proof at length: every crash point,
//! then `EITRI_CHAOS_KILLS` (default 1,000) random kills. The last line is
//! `bench=chaos points=… point_runs=… random_kills=… violations=…
//! converge_s_p50=… converge_s_p99=…`; every violation is printed above it.

#[path = "../chaos/driver.rs"]
mod driver;

fn main() {
    let kills = std::env::var("EITRI_CHAOS_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(1000);

    // In a network namespace of its own, as the test's: the bridge, nft
    // tables and routes the agents make go with it, and none the host
    // already has (a stale bridge with the guests' subnet) takes their
    // frames.
    eitri_agent::testkit::net::private_network();
    let summary = driver::run(kills);

    for v in &summary.violations {
        println!("violation: {v}");
    }
    println!("{}", summary.line());
    if !summary.violations.is_empty() {
        std::process::exit(1);
    }
}
