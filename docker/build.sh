#!/usr/bin/env bash
# Build the job images and, with --push, push them to Amazon ECR.
#
#   docker/build.sh                         # build llmops-train:<version> and llmops-data:<version>
#   docker/build.sh --push --region us-east-1 [--account 123456789012] [--tag 0.1.0]
#
# <version> defaults to `git describe --always --dirty`. The training image's base is an AWS Deep
# Learning Container in account 763104351884, so the build logs in to that registry first (your
# credentials need ecr:GetAuthorizationToken). Pushing creates the ECR repositories if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

push=false
region="${AWS_REGION:-${AWS_DEFAULT_REGION:-us-east-1}}"
account=""
tag="$(git describe --always --dirty 2>/dev/null || echo dev)"
images=(train data)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --push) push=true ;;
    --region) region="$2"; shift ;;
    --account) account="$2"; shift ;;
    --tag) tag="$2"; shift ;;
    --only) images=("$2"); shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

dlc_registry="763104351884.dkr.ecr.${region}.amazonaws.com"
if [[ " ${images[*]} " == *" train "* ]]; then
  aws ecr get-login-password --region "$region" | docker login --username AWS --password-stdin "$dlc_registry"
fi

registry=""
if $push; then
  account="${account:-$(aws sts get-caller-identity --query Account --output text)}"
  registry="${account}.dkr.ecr.${region}.amazonaws.com"
  aws ecr get-login-password --region "$region" | docker login --username AWS --password-stdin "$registry"
fi

for image in "${images[@]}"; do
  name="llmops-${image}"
  base_arg=()
  if [[ "$image" == train ]]; then
    # The DLC lives in each region's registry; keep the pinned tag, change only the region.
    default_base="$(sed -n 's/^ARG BASE_IMAGE=//p' docker/Dockerfile.train)"
    base_arg=(--build-arg "BASE_IMAGE=${default_base/us-east-1/$region}")
  fi
  # BuildKit reads docker/Dockerfile.<image>.dockerignore: only tasks/ and the entry go in.
  DOCKER_BUILDKIT=1 docker build -f "docker/Dockerfile.${image}" "${base_arg[@]}" -t "${name}:${tag}" .
  echo "built ${name}:${tag}"
  if $push; then
    aws ecr describe-repositories --region "$region" --repository-names "$name" >/dev/null 2>&1 \
      || aws ecr create-repository --region "$region" --repository-name "$name" \
           --image-scanning-configuration scanOnPush=true >/dev/null
    docker tag "${name}:${tag}" "${registry}/${name}:${tag}"
    docker push "${registry}/${name}:${tag}"
    echo "pushed ${registry}/${name}:${tag}"
  fi
done
