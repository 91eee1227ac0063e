# Shared by deploy/compose/up and deploy/compose/down (sourced, not run).
# Needs: $here (this directory), $project, $state.

# Checks docker, its daemon and docker-compose; sets compose_cmd.
find_docker_compose() {
    if ! command -v docker >/dev/null 2>&1; then
        echo "compose: docker not found: install Docker Engine (Debian: apt-get install docker.io docker-compose) and retry" >&2
        exit 1
    fi
    local err
    if ! err=$(docker info --format '{{.ServerVersion}}' 2>&1 >/dev/null); then
        echo "compose: cannot reach the Docker daemon: ${err:-docker info failed}" >&2
        echo "compose: is it running (systemctl start docker), and may you use it (the docker group)?" >&2
        exit 1
    fi
    if command -v docker-compose >/dev/null 2>&1; then
        compose_cmd=(docker-compose)
    elif docker compose version >/dev/null 2>&1; then
        compose_cmd=(docker compose)
    else
        echo "compose: docker-compose not found: install it (Debian: apt-get install docker-compose; or the Compose plugin, docker-compose-plugin) and retry" >&2
        exit 1
    fi
}

# docker-compose for this project.
dc() {
    local env=()
    [ -f "$state/compose.env" ] && env=(--env-file "$state/compose.env")
    "${compose_cmd[@]}" --project-name "$project" --file "$here/docker-compose.yml" "${env[@]}" "$@"
}

# The same, as a command line to print.
dc_command_line() {
    local line="${compose_cmd[*]} --project-name $project --file $here/docker-compose.yml"
    [ -f "$state/compose.env" ] && line="$line --env-file $state/compose.env"
    echo "$line"
}
