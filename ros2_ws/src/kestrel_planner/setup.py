from glob import glob

from setuptools import find_packages, setup

package_name = 'kestrel_planner'

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/config', glob('config/*.yaml')),
        ('share/' + package_name + '/weights', glob('weights/*.pt') + glob('weights/*.json')),
    ],
    package_data={package_name: ['worlds/*.xml']},
    include_package_data=True,
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='Kestrel developers',
    maintainer_email='dev@kestrel.invalid',
    description='Kestrel vision-language task planner node (PlanTask action).',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'planner_node = kestrel_planner.planner_node:main',
        ],
    },
)
