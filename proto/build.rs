//! Generates the gRPC code from `kvota/v1/kvota.proto` and `kvota/raft/v1/raft.proto` with a vendored `protoc`, so
//! building needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=kvota/v1/kvota.proto");
    println!("cargo:rerun-if-changed=kvota/raft/v1/raft.proto");
    println!("cargo:rerun-if-changed=etcd/kv.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    // Maps as BTreeMap: the same message encodes to the same bytes on every node.
    config.btree_map(["."]);
    tonic_prost_build::configure().compile_with_config(
        config,
        &["kvota/v1/kvota.proto", "kvota/raft/v1/raft.proto"],
        &["."],
    )?;
    // Client only: the benchmark drives etcd with it.
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .compile_with_config(config, &["etcd/kv.proto"], &["."])?;
    Ok(())
}
