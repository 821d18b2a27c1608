"""Attacks from the VFL survey (label inference, gradient-replacement backdoor, reconstruction).

Attacks are malicious parties or curious channel layers plugged into the core's seam. Nothing is
implemented here yet: see the project's open issues.
"""
