// SPDX-License-Identifier: Apache-2.0
// placeholder replaced below
int main() {}
