//! Generates the gRPC code from `kvota/v1/kvota.proto` with a vendored `protoc`, so
//! building needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=kvota/v1/kvota.proto");
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().compile_with_config(config, &["kvota/v1/kvota.proto"], &["."])?;
    Ok(())
}
