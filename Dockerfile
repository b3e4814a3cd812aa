# syntax=docker/dockerfile:1
#
# One image for the zarrlake operator and the workloads it runs:
#   operator:  python -m zarrlake_operator run --all-namespaces
#   jobs:      zarrlake gc ... / zarrlake compact ...
#   servers:   zarrlake serve URL --host 0.0.0.0 --port 8700   (a Repository's spec.serve)
# No special entrypoint; the chart and the objects the operator makes give the command.
#
#   make image        (docker build with the base image's recorded digest; see below)

# The base, pinned by digest: a tag can be moved to other bytes, a digest cannot. The tag and its
# digest are recorded in requirements/base-image.env (`make lock-base`, on a machine that can
# reach the registry); `make image` passes both. There is no default digest: without
# --build-arg PYTHON_IMAGE_DIGEST=sha256:... the reference below is not a valid image name, and
# the build stops at its first FROM. requirements/image.txt is locked for CPython 3.11 on
# linux/amd64.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG PYTHON_IMAGE_DIGEST

# -- build: wheels of zarrlake and of everything it needs -------------------------------------------
FROM ${PYTHON_IMAGE}@${PYTHON_IMAGE_DIGEST} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
COPY requirements/image.txt requirements/build.txt requirements/
# Every dependency exactly as locked (version and sha256 of each file: `make lock` writes the
# locks), then the project's own wheel, built by the locked setuptools (no build isolation: pip
# would fetch an unpinned one): the final stage installs offline from /wheels and carries no
# build tooling.
RUN pip wheel --wheel-dir /wheels --require-hashes --only-binary=:all: -r requirements/image.txt \
 && pip install --require-hashes --only-binary=:all: -r requirements/build.txt
COPY pyproject.toml README.md ./
COPY client/ client/
COPY operator/ operator/
RUN pip wheel --wheel-dir /wheels --no-deps --no-build-isolation .

# -- runtime ----------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}@${PYTHON_IMAGE_DIGEST}

ARG VERSION=0.4.0
LABEL org.opencontainers.image.title="zarrlake" \
      org.opencontainers.image.description="zarrlake operator, maintenance jobs and server" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# Nothing writes bytecode at run time (the chart mounts the root file system read-only; pip
# compiles the installed modules ahead of time); logs go out unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN groupadd --system --gid 10001 zarrlake \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/zarrlake --create-home \
        --shell /usr/sbin/nologin zarrlake

# The wheels are bind-mounted from the build stage, so they never become a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "zarrlake[s3,gcs,azure,http,operator,serve]" \
 && python -c "import zarrlake, zarrlake_operator, boto3, obstore, google.auth, urllib3" \
 && python -c "import starlette, uvicorn, jinja2" \
 && zarrlake --help > /dev/null

WORKDIR /home/zarrlake
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001

# 8080/9090: the operator's probes and metrics; 8700: zarrlake serve's default port.
EXPOSE 8080 9090 8700
CMD ["zarrlake", "--help"]
