fn main() -> std::process::ExitCode {
    outbox_relay::cli::main()
}
