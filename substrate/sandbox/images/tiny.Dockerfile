# substrate-tiny:latest — a busybox-only image for fast tests, built with no registry.
#
# The build context is assembled by substrate.imagebuild.build_tiny: this file, the
# host's statically linked /bin/busybox (Debian package busybox-static), and the
# passwd/group files next to this one. Build steps run with no network.
FROM scratch
COPY busybox /bin/busybox
COPY tiny-passwd /etc/passwd
COPY tiny-group /etc/group
# One fixed script, run by busybox's own shell: applet links in /bin, a sticky /tmp,
# and a home for user 1000.
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox --install -s /bin && /bin/busybox mkdir -p -m 1777 /tmp && /bin/busybox mkdir -p /home/agent && /bin/busybox chown 1000:1000 /home/agent"]
ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
LABEL substrate.image=tiny
USER 1000:1000
WORKDIR /home/agent
CMD ["/bin/sh"]
