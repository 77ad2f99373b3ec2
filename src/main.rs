//! The `eitri-agent` binary: parse, run, print the error chain, exit.

use std::process::ExitCode;

use eitri_agent::version::AGENT_VERSION;

const USAGE: &str = "\
usage: eitri-agent [--version | --help]

The host agent of the eitri microVM platform.

Options:
  --version   print the agent's release and exit
  --help      print this help and exit
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["--version"] | ["-V"] => {
            println!("eitri-agent {AGENT_VERSION}");
            ExitCode::SUCCESS
        }
        [] | ["--help"] | ["-h"] => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        [other, ..] => {
            eprintln!("eitri-agent: unknown argument {other:?}; see eitri-agent --help");
            ExitCode::from(2)
        }
    }
}
