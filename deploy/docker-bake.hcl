# Every image at once: `make images` (docker buildx bake -f deploy/docker-bake.hcl), or a group:
# `... bake cpu` / `... bake gpu`. TAG and REGISTRY set the names (pdserve/<target>:<TAG>).
variable "TAG" { default = "0.1.0" }
variable "REGISTRY" { default = "pdserve" }

group "default" { targets = ["cpu", "gpu"] }
group "cpu" { targets = ["gateway", "router", "kvd", "prefill", "decode"] }
group "gpu" { targets = ["gpu-prefill", "gpu-decode"] }

target "_common" {
  context    = "."
  dockerfile = "deploy/Dockerfile"
  platforms  = ["linux/amd64"]
}

target "gateway" {
  inherits = ["_common"]
  target   = "gateway"
  tags     = ["${REGISTRY}/gateway:${TAG}"]
}

target "router" {
  inherits = ["_common"]
  target   = "router"
  tags     = ["${REGISTRY}/router:${TAG}"]
}

target "kvd" {
  inherits = ["_common"]
  target   = "kvd"
  tags     = ["${REGISTRY}/kvd:${TAG}"]
}

target "prefill" {
  inherits = ["_common"]
  target   = "prefill"
  tags     = ["${REGISTRY}/prefill:${TAG}"]
}

target "decode" {
  inherits = ["_common"]
  target   = "decode"
  tags     = ["${REGISTRY}/decode:${TAG}"]
}

target "gpu-prefill" {
  inherits = ["_common"]
  target   = "gpu-prefill"
  tags     = ["${REGISTRY}/gpu-prefill:${TAG}"]
}

target "gpu-decode" {
  inherits = ["_common"]
  target   = "gpu-decode"
  tags     = ["${REGISTRY}/gpu-decode:${TAG}"]
}
