# eitri-agent: build, test, benchmark.
#
#   make test         everything CI runs: format, lint, docs, the MSRV build, programs and
#                     generated-code checks, no fakes in a release, tests
#   make proto        regenerate src/pb/ from proto/ (no protoc needed)
#   make bench        every benchmark; make bench-NAME runs one
#   make chaos        the crash-consistency proof at length (1,000 random kills)
#   make soak         a host's long life in minutes: nothing the agent adds may grow (root)
#   make e2e-real     a real Linux guest under the agent (builds what is missing; root)
#   make compat       the real-hypervisor checks against each binary in EITRI_COMPAT_HYPERVISORS (root)
#
# Each benchmark's last line is `bench=NAME key=value ...`.

CARGO    ?= cargo
PROTOGEN := contrib/protogen
GENERATED := src/pb/eitri.agent.v1.rs src/pb/eitri.guest.v1.rs
BENCHES  := store engine storage boot create suspend wake clone probe intake net repair limits usage

MUSL     := x86_64-unknown-linux-musl
STATIC   := target/$(MUSL)/release/eitri-agent

.PHONY: soak e2e-real compat tls-check bench-scale docs msrv-check release-check macos-check mac-check chaos all build static test fmt-check clippy programs-check proto proto-check unit-tests bench $(addprefix bench-,$(BENCHES))

all: build

# The crash-consistency proof at length (1,000 random kills; CI runs 50).
chaos:
	$(CARGO) bench --locked --features standin,crashpoints --bench chaos
	contrib/leftovers

# Rounds of churn on one agent (VMs, suspends, VMM and agent kills, state
# dirs released and abandoned); every host resource counted before and
# after. EITRI_SOAK_ROUNDS=5000 for ten times the default.
soak:
	$(CARGO) bench --locked --features standin --bench soak

build:
	$(CARGO) build --release --locked

# Layer 5: a real Linux guest (cloud-init, sshd, DHCP, NAT, suspend and
# resume) under the agent binary. Builds the kernel, root filesystem and
# hypervisor it lacks into a cache outside the repository (the script's
# header says which, and from what), then runs tests/real_guest.rs.
e2e-real:
	CARGO=$(CARGO) contrib/e2e-real

compat:
	CARGO=$(CARGO) contrib/compat

# A fully static, stripped binary for hosts (needs: rustup target add $(MUSL)).
static:
	$(CARGO) build --release --locked --target $(MUSL)
	@ls -l $(STATIC)

MACOS    := aarch64-apple-darwin x86_64-apple-darwin

test: fmt-check clippy docs msrv-check release-check programs-check proto-check macos-check tls-check unit-tests

fmt-check:
	$(CARGO) fmt --check

clippy:
	$(CARGO) clippy --locked --all-targets --features standin,crashpoints -- -D warnings

# The docs build with every private item, warnings denied: about 130
# intra-doc links carry the design, and a broken one fails here.
docs:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --locked --no-deps --document-private-items --features standin,crashpoints

# The oldest Rust the crate declares (Cargo.toml's rust-version) builds it
# (needs: rustup toolchain install $(MSRV) --profile minimal).
MSRV := $(shell sed -n 's/^rust-version = "\([0-9.]*\)".*/\1/p' Cargo.toml)
msrv-check:
	$(CARGO) +$(MSRV) check --locked --lib --bins --tests --features standin,crashpoints

# A release build of the library holds none of the fakes (src/testkit is
# built only with the testkit feature): no symbol of it is in the rlib.
release-check:
	$(CARGO) build --release --locked --lib
	@if strings target/release/libeitri_agent.rlib | grep -q wait_entered; then \
	  echo "the release library contains src/testkit" >&2; exit 1; fi

# The macOS build compiles (lib, bins, tests; no Mac here to link or run
# it): needs rustup target add $(MACOS).
macos-check:
	for t in $(MACOS); do \
	  $(CARGO) check --locked --target $$t --lib --bins --tests || exit 1; \
	  $(CARGO) check --locked --target $$t --lib --bins --tests --features standin,crashpoints || exit 1; \
	done

# On a Mac with vfkit installed: what Linux cannot show (README, macOS).
mac-check:
	contrib/mac-check

# Every program the code or its tests run is installed by .ci/run.
programs-check:
	.ci/check-programs

# nextest's summary is the run's last line; CI reads it. The s6 test runs
# the static binary, so it is built first.
# The tls feature builds, passes clippy and its tests (tests/tls.rs).
tls-check:
	$(CARGO) clippy --locked --lib --tests --features tls,testkit -- -D warnings
	$(CARGO) nextest run --locked --no-fail-fast --features tls,testkit --test tls

unit-tests: static
	$(CARGO) nextest run --locked --no-fail-fast --features standin,crashpoints
	contrib/leftovers

proto:
	$(CARGO) run --quiet --locked --manifest-path $(PROTOGEN)/Cargo.toml -- proto src/pb
	rustfmt --edition 2024 $(GENERATED)

# Regenerates into a temp dir and compares: fails when the committed code is
# stale, and never touches the tree.
proto-check:
	@tmp=$$(mktemp -d) && \
	$(CARGO) run --quiet --locked --manifest-path $(PROTOGEN)/Cargo.toml -- proto $$tmp && \
	rustfmt --edition 2024 $$tmp/*.rs && \
	if for f in $(GENERATED); do diff -u $$f $$tmp/$$(basename $$f) || exit 1; done; then rm -rf $$tmp; \
	else rm -rf $$tmp; echo "$(GENERATED) is stale: run make proto and commit it" >&2; exit 1; fi

bench: $(addprefix bench-,$(BENCHES)) bench-scale

# The engine at 100, 1,000 and 10,000 VMs, and how its step's p99 grows.
# Built as the agent ships (static, musl): its allocator keeps no per-thread
# caches, which a glibc build keeps for each of 10,000 workers (~45 MB more
# resident there). SCALE_TARGET=x86_64-unknown-linux-gnu measures that build.
SCALE_TARGET ?= $(MUSL)
bench-scale:
	@for n in 100 1000 10000; do \
	  EITRI_BENCH_VMS=$$n $(CARGO) bench --locked --features standin --target $(SCALE_TARGET) --bench engine 2>/dev/null | tail -n 1 | tee /dev/stderr; \
	done | awk '{ for (i = 1; i <= NF; i++) { split($$i, kv, "="); v[kv[1]] = kv[2] } \
	  p99[v["vms"]] = v["step_p99_us"]; rss[v["vms"]] = v["rss_mb"]; conv[v["vms"]] = v["converge_calibrated_ratio"] } \
	  END { printf "bench=scale target=$(SCALE_TARGET) step_p99_us_100=%s step_p99_us_1000=%s step_p99_us_10000=%s growth_10k_over_1k=%.2f rss_mb_1000=%s rss_mb_10000=%s converge_ratio_10000=%s\n", \
	    p99[100], p99[1000], p99[10000], p99[10000] / p99[1000], rss[1000], rss[10000], conv[10000] }'

# Each benchmark ends what it started (its harness's drop); contrib/leftovers
# checks that it did.
$(addprefix bench-,$(BENCHES)): bench-%:
	$(CARGO) bench --locked --features standin --bench $*
	contrib/leftovers
